"""Tool calls read out of text (api/tool_parsers.py): each format, text without calls, malformed calls,
and the streaming property: the pieces sent while the text grows, whatever its cut points, assemble to
exactly what the whole text gives at once."""

from __future__ import annotations

import json
import random

import pytest

from api.tool_parsers import (TOOL_PARSERS, GenericParser, HermesParser, JsonParser, NamedCallParser,
                              RequiredCallsParser, ToolCallExtractor, check_tool_parser)


def extract(parser, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(content or None, [(name, arguments)]) of the whole text at once, as a non-streamed answer."""
    content, pieces = ToolCallExtractor(parser).update(text, final=True)
    return content or None, assemble(pieces)


def assemble(pieces) -> list[tuple[str, str]]:
    calls: list[list[str]] = []
    for piece in pieces:
        if piece.id is not None:
            assert piece.id.startswith("call_") and piece.index == len(calls) and piece.arguments == ""
            calls.append([piece.name, ""])
        else:
            assert piece.name is None
            calls[piece.index][1] += piece.arguments
    return [tuple(call) for call in calls]


def stream(parser, text: str, cuts: list[int]) -> tuple[str | None, list[tuple[str, str]]]:
    """The same, fed in growing prefixes ending at ``cuts`` and then the whole text (final)."""
    extractor, content, pieces = ToolCallExtractor(parser), "", []
    ends = sorted(set(cuts)) + [len(text)]
    for i, end in enumerate(ends):
        new, new_pieces = extractor.update(text[:end], final=i == len(ends) - 1)
        content += new
        pieces += new_pieces
    return content or None, assemble(pieces)


HERMES = ('Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
          '</tool_call>\n<tool_call>{"name": "time", "arguments": {}}</tool_call>')
JSON_ONE = '{"name": "weather", "parameters": {"city": "Oslo \\"}\\" x"}}'
JSON_LIST = ' [{"name": "weather", "arguments": {"city": "Rome"}}, {"arguments": "{\\"tz\\": 1}", "name": "time"}]'


@pytest.mark.parametrize("parser, text, expected", [
    (HermesParser(), HERMES, ("Let me check.\n", [("weather", '{"city": "Paris", "days": [1, 2]}'),
                                                  ("time", "{}")])),
    (GenericParser(), HERMES, ("Let me check.\n", [("weather", '{"city": "Paris", "days": [1, 2]}'),
                                                   ("time", "{}")])),
    (HermesParser(), '<tool_call>{"name": "f", "arguments": {"a": 1}}', (None, [("f", '{"a": 1}')])),
    (JsonParser(), JSON_ONE, (None, [("weather", '{"city": "Oslo \\"}\\" x"}')])),
    (GenericParser(), JSON_ONE, (None, [("weather", '{"city": "Oslo \\"}\\" x"}')])),
    (JsonParser(), JSON_LIST, (None, [("weather", '{"city": "Rome"}'), ("time", '{"tz": 1}')])),
    (GenericParser(), JSON_LIST, (None, [("weather", '{"city": "Rome"}'), ("time", '{"tz": 1}')])),
    (RequiredCallsParser(), '[{"name": "f", "arguments": {"x": true}}]', (None, [("f", '{"x": true}')])),
    (NamedCallParser("f"), ' {"x": [1, 2]} \n', (None, [("f", '{"x": [1, 2]}')])),
])
def test_calls_are_read_in_each_format(parser, text, expected):
    assert extract(parser, text) == expected
    assert json.loads(expected[1][0][1]) is not None


@pytest.mark.parametrize("parser", [HermesParser(), JsonParser(), GenericParser()])
@pytest.mark.parametrize("text", [
    "The weather in Paris is sunny.",
    "Use <tool_call to call tools",
    '{"city": "Paris"}',  # an object without a name and arguments is no call
    '{"name": "Bob", "age": 3}',
    "[1, 2, 3]",
    "",
    "  \n",
])
def test_text_without_calls_is_all_content(parser, text):
    assert extract(parser, text) == (text or None, [])


@pytest.mark.parametrize("parser, text", [
    (GenericParser(), '<tool_call>{"name": 5, "arguments": {}}</tool_call>'),
    (GenericParser(), '<tool_call>{name: "f"}</tool_call>'),
    (GenericParser(), '<tool_call>not json</tool_call>'),
    (JsonParser(), '{"name": "f" "arguments": {}}'),
    (JsonParser(), '{"name": "", "arguments": {}}'),
    (JsonParser(), '{"name": "f", "arguments": }'),
    (RequiredCallsParser(), '{"name": "f", "arguments": {}}'),  # the required form is a list
])
def test_malformed_calls_come_back_as_content(parser, text):
    assert extract(parser, text) == (text, [])


def test_a_truncated_call_keeps_its_partial_arguments_and_later_malformed_items_are_ignored():
    assert extract(RequiredCallsParser(), '[{"name": "f", "arguments": {"q": "ab') == (None, [("f", '{"q": "ab')])
    assert extract(JsonParser(), '[{"name": "f", "arguments": {}}, {"oops": 1}, {"name": "g", "arguments": {}}]') \
        == (None, [("f", "{}")])


@pytest.mark.parametrize("parser, text", [
    (GenericParser(), HERMES), (HermesParser(), HERMES), (JsonParser(), JSON_ONE), (GenericParser(), JSON_LIST),
    (RequiredCallsParser(), '[ {"name": "f", "arguments": {"x": "a}b", "y": [1, {"z": null}]}} ,'
                            '{"name": "g", "arguments": {}} ]'),
    (NamedCallParser("f"), '\n{"x": "a b", "y": 12.5}\t'),
    (GenericParser(), "Hello <tool world, no calls here"),
    (GenericParser(), '{"not": "a call"}'),
    (RequiredCallsParser(), '[{"name": "f", "arguments": {"q": 12'),
])
def test_streamed_pieces_assemble_to_the_whole_answer_at_any_cut_points(parser, text):
    whole = extract(parser, text)
    assert stream(parser, text, list(range(1, len(text)))) == whole  # character by character
    rng = random.Random(0)
    for _ in range(30):
        assert stream(parser, text, rng.sample(range(1, len(text)), rng.randint(1, 6))) == whole


def test_streamed_arguments_are_sent_as_they_are_written():
    text = '[{"name": "f", "arguments": {"city": "Paris"}}]'
    extractor = ToolCallExtractor(RequiredCallsParser())
    assert extractor.update('[{"name": "f", "argu', False) == ("", [])  # the name alone is no call yet
    _, pieces = extractor.update('[{"name": "f", "arguments": {"ci', False)
    assert [(p.index, p.name, p.arguments) for p in pieces] == [(0, "f", ""), (0, None, '{"ci')]
    _, pieces = extractor.update(text, True)
    assert [(p.index, p.id, p.arguments) for p in pieces] == [(0, None, 'ty": "Paris"}')]


def test_content_before_a_hermes_call_streams_and_a_partial_tag_is_held():
    extractor = ToolCallExtractor(GenericParser())
    assert extractor.update("Sure", False) == ("Sure", [])
    assert extractor.update("Sure <tool_c", False) == (" ", [])  # "<tool_c" may open a call
    content, pieces = extractor.update('Sure <tool_call>{"name": "f", "arguments": {}}', False)
    assert content == "" and [p.name for p in pieces if p.id] == ["f"]


def test_parser_names_are_checked():
    assert set(TOOL_PARSERS) == {"generic", "hermes", "llama3_json"}
    assert check_tool_parser("hermes") == "hermes"
    with pytest.raises(ValueError, match="tool_call_parser must be one of generic, hermes, llama3_json, got 'x'"):
        check_tool_parser("x")
