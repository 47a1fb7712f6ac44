"""Tool-call parsing while a text streams is incremental (api/tool_parsers.py, api/partial_json.py): an
extractor fed a growing text gives, at every update, exactly what a stateless extractor scanning each
whole text afresh gives (random texts, random split points, every parser), and a 130k-character
stream fed 4 characters at a time costs a bounded multiple of one whole-text scan, not one scan per
delta."""

from __future__ import annotations

import random
import time

import pytest

from api.partial_json import WS
from api.tool_parsers import (GenericParser, HermesParser, JsonParser, NamedCallParser, RequiredCallsParser,
                              ToolCallExtractor)

PARSERS = [GenericParser(), HermesParser(), JsonParser(), RequiredCallsParser(), NamedCallParser("f")]
ATOMS = ['{', '}', '[', ']', '"', '\\', ',', ':', ' ', '\n', '"name"', '"arguments"', '"parameters"', '"f"', '"g"',
         '12', 'true', 'x', '<tool_call>', '<tool', '_call>', '</tool_call>', '{"name": "f", "arguments": ',
         '"a\\"}"', '{"x": [1, {"y": "}"}]}', '"{\\"k\\": 1}"', '"name": ""', 'Hi ']


class WholeTextExtractor:
    """The oracle: every update scans the whole text with a fresh scan (no state kept between scans)
    and finds what is new by comparing strings, as the extractor did before it kept state."""

    def __init__(self, parser) -> None:
        self.parser, self.content, self.sent = parser, "", []

    def update(self, text: str, final: bool):
        scan = self.parser.scan(text, final)
        content = text[:scan.content_end]
        if not content.strip(WS) and not (final and not scan.calls):
            content = ""
        new_content = content[len(self.content):] if content.startswith(self.content) else ""
        self.content += new_content
        pieces = []
        for index, span in enumerate(scan.calls):
            if index == len(self.sent):
                self.sent.append("")
                pieces.append((index, "", True, span.name))
            arguments = span.arguments(text)
            if len(arguments) > len(self.sent[index]) and arguments.startswith(self.sent[index]):
                pieces.append((index, arguments[len(self.sent[index]):], False, None))
                self.sent[index] = arguments
        return new_content, pieces


def pieces_of(deltas) -> list[tuple]:
    return [(d.index, d.arguments, d.id is not None, d.name) for d in deltas]


def random_text(rng: random.Random) -> str:
    text = "".join(rng.choice(ATOMS) for _ in range(rng.randint(0, 30)))
    return rng.choice(["[", "", " ", "<tool_call>", "a <tool_call>\n"]) + text


@pytest.mark.parametrize("seed", range(4))
def test_every_update_equals_a_fresh_scan_of_the_whole_text(seed):
    rng = random.Random(seed)
    updates = 0
    for _ in range(400):
        text, parser = random_text(rng), rng.choice(PARSERS)
        if rng.random() < 0.3:
            ends = list(range(len(text) + 1))  # one character at a time
        else:
            ends = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 8))))
        incremental, oracle = ToolCallExtractor(parser), WholeTextExtractor(parser)
        for k, end in enumerate(ends):
            final = k == len(ends) - 1 and rng.random() < 0.8
            content, deltas = incremental.update(text[:end], final)
            assert (content, pieces_of(deltas)) == oracle.update(text[:end], final), (parser.name, text, end)
            assert incremental.content == oracle.content
            assert [c.arguments for c in incremental.calls] == oracle.sent
            updates += 1
    assert updates > 1000


def test_a_text_that_does_not_extend_the_last_is_scanned_afresh():
    for parser in (GenericParser(), RequiredCallsParser()):
        incremental, oracle = ToolCallExtractor(parser), WholeTextExtractor(parser)
        for text, final in [('[{"name": "f", "arguments": {"a": 1', False), ('[{"name": "g", "argu', False),
                            ('[{"name": "f", "arguments": {"a": 12}}]', False),
                            ('Hi <tool_call>{"name": "h", "arguments": [1]}', True)]:
            content, deltas = incremental.update(text, final)
            assert (content, pieces_of(deltas)) == oracle.update(text, final)
        assert [c.arguments for c in incremental.calls] == oracle.sent == ['{"a": 12}']


def long_call(length: int) -> str:
    arguments = '{"text": "' + "lorem ipsum, " * (length // 13) + '", "n": [1, 2, {"a": "b"}]}'
    return ('Sure.\n<tool_call>{"name": "write", "arguments": ' + arguments + "}</tool_call>")[:length]


def test_a_long_stream_costs_a_bounded_multiple_of_one_whole_text_scan():
    text = long_call(130_000)
    whole = min(_timed(lambda: ToolCallExtractor(GenericParser()).update(text, False)) for _ in range(3))
    budget = 200 * whole  # a scan per delta costs about 8000 whole scans here (32,500 deltas)
    extractor, content, arguments = ToolCallExtractor(GenericParser()), "", ""
    start = time.perf_counter()
    for end in range(4, len(text) + 4, 4):
        new, deltas = extractor.update(text[:end], end >= len(text))
        content += new
        arguments += "".join(d.arguments for d in deltas)
        elapsed = time.perf_counter() - start
        assert elapsed < budget, f"{end} of {len(text)} characters took {elapsed:.2f} s, over {budget:.2f} s"
    assert content == "Sure.\n" and [c.name for c in extractor.calls] == ["write"]
    # the text ends inside the arguments' string: they are sent as written, but the trailing space
    assert arguments == text[len('Sure.\n<tool_call>{"name": "write", "arguments": '):].rstrip(WS)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
