"""Structured outputs and tool calls through the official ``openai`` client against the real app over an
in-process engine on the tiny random-weight llama. Its text is nonsense, so each test checks the
constraint: calls whose arguments validate against their tool's schema, outputs finishing with "stop"
that validate against the response format's schema, choices and regexes kept; the SDK's structured
output helper parses; streamed tool-call pieces assemble to the non-streamed call; constraints that
do not compile are 400s with an OpenAI error body, and leave the engine clean."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from pydantic import BaseModel, Field

from tests.serve.openai_harness import (MODEL, app, assert_error, client, http, llm, model_dir,  # noqa: F401
                                        run, until_clean)

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK, "strict": True}}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
SEEDS = range(8)
MAX_TOKENS = 256


def check_calls(message, parallel: bool = True) -> None:
    """The message holds only calls, each of a given tool, with arguments valid for its schema."""
    assert message.content is None and message.tool_calls
    assert parallel or len(message.tool_calls) == 1
    for call in message.tool_calls:
        assert call.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call.id)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_returns_calls_valid_for_their_tools(client, llm, run, parallel):
    async def main():
        return [await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
            seed=seed, max_tokens=MAX_TOKENS) for seed in SEEDS]

    finished = 0
    for response in run(main()):
        choice = response.choices[0]
        assert choice.finish_reason in ("tool_calls", "length")
        if choice.finish_reason == "tool_calls":
            check_calls(choice.message, parallel)
            finished += 1
    assert finished, "no seed finished its calls"
    run(until_clean(llm))


class Address(BaseModel):
    city: Literal["Paris", "Oslo"]
    zone: int = Field(ge=0, le=9)


class Move(BaseModel):
    home: Address
    work: Address | None


def test_required_calls_of_pydantic_tools_whose_schemas_reference_definitions(client, run):
    """The SDK's pydantic tools write nested models as ``$defs`` and ``$ref``; the calls still follow them."""
    tools = [openai.pydantic_function_tool(Move, name="move"), openai.pydantic_function_tool(Address, name="visit")]
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    assert "$defs" in schemas["move"]

    async def main():
        return [await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=tools, seed=seed,
                                                     tool_choice="required", max_tokens=MAX_TOKENS)
                for seed in SEEDS]

    finished = [r.choices[0] for r in run(main()) if r.choices[0].finish_reason == "tool_calls"]
    assert finished
    for choice in finished:
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert "move" in {call.function.name for choice in finished for call in choice.message.tool_calls}


def test_a_named_tool_choice_calls_that_function(client, run):
    async def main():
        return [await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS, seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_time"}}) for seed in SEEDS]

    finished = [r.choices[0] for r in run(main()) if r.choices[0].finish_reason == "tool_calls"]
    assert finished
    for choice in finished:
        check_calls(choice.message, parallel=False)
        assert choice.message.tool_calls[0].function.name == "get_time"


def test_streamed_tool_call_pieces_assemble_to_the_non_streamed_calls(client, run):
    def body(seed: int) -> dict:
        return dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", seed=seed,
                    max_tokens=MAX_TOKENS)

    async def main(seed: int):
        whole = await client.chat.completions.create(**body(seed))
        stream = await client.chat.completions.create(**body(seed), stream=True)
        return whole, [chunk async for chunk in stream]

    compared = 0
    for seed in SEEDS:
        whole, chunks = run(main(seed))
        if whole.choices[0].finish_reason != "tool_calls":
            continue
        pieces = [p for c in chunks for choice in c.choices for p in choice.delta.tool_calls or ()]
        firsts = [p for p in pieces if p.id is not None]
        # the first piece of a call: index, id, type, name and empty arguments; then fragments only
        assert [p.index for p in firsts] == list(range(len(whole.choices[0].message.tool_calls)))
        assert all(p.type == "function" and p.function.name and p.function.arguments == "" for p in firsts)
        assert all(p.type is None and p.function.name is None for p in pieces if p.id is None)
        assert len(pieces) > 2 * len(firsts)  # the arguments came in more than one fragment
        state = ChatCompletionStreamState()  # the SDK's own assembly of a stream
        for chunk in chunks:
            state.handle_chunk(chunk)
        assembled = state.get_final_completion().choices[0]
        assert assembled.finish_reason == "tool_calls" and assembled.message.content is None

        def calls(message) -> list[tuple]:
            return [(c.function.name, c.function.arguments) for c in message.tool_calls]

        assert calls(assembled.message) == calls(whole.choices[0].message)
        compared += 1
    assert compared


class Verdict(BaseModel):
    answer: Literal["yes", "no", "maybe"]
    score: int = Field(ge=0, le=9)
    certain: bool


def test_sdk_parse_with_a_pydantic_model(client, run):
    async def main():
        parsed = []
        for seed in SEEDS:
            try:
                parsed.append(await client.chat.completions.parse(
                    model=MODEL, messages=MESSAGES, response_format=Verdict, seed=seed, max_tokens=MAX_TOKENS))
            except openai.LengthFinishReasonError:  # the nonsense did not close the object in time
                pass
        return parsed

    completions = run(main())
    assert completions
    for completion in completions:
        message = completion.choices[0].message
        assert isinstance(message.parsed, Verdict)
        assert message.parsed == Verdict.model_validate_json(message.content)


NESTED = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": -5, "maximum": 5},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
    "size": {"anyOf": [{"type": "boolean"}, {"type": "null"}, {"enum": ["S", "M", "L"]}]},
    "point": {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1},
                                               "y": {"type": "integer"}}, "required": ["x"],
              "additionalProperties": False}},
    "required": ["id", "point"], "additionalProperties": False}


@pytest.mark.parametrize("schema", [NESTED, WEATHER], ids=["nested", "enums"])
def test_json_schema_outputs_that_stop_validate(client, run, schema):
    async def main():
        return await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, n=8, seed=1, max_tokens=MAX_TOKENS,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})

    choices = run(main()).choices
    stopped = [c for c in choices if c.finish_reason == "stop"]
    assert len(stopped) >= 2, [c.finish_reason for c in choices]
    for choice in stopped:
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_outputs_that_stop_are_objects(client, run):
    async def main():
        return await client.completions.create(model=MODEL, prompt="A JSON object:", n=8, seed=3,
                                               max_tokens=MAX_TOKENS,
                                               extra_body={"response_format": {"type": "json_object"}})

    choices = run(main()).choices
    assert all(c.text.lstrip(" \t\n\r")[:1] == "{" for c in choices)  # cut or not, each opens an object
    stopped = [c for c in choices if c.finish_reason == "stop"]
    assert stopped
    assert all(isinstance(json.loads(c.text), dict) for c in stopped)


def test_guided_choice_and_regex_over_completions(client, run):
    colors = ["red", "green", "dark blue"]
    pattern = r"[a-c]{2,4}-\d{1,3}"

    async def main():
        by_choice = await client.completions.create(model=MODEL, prompt="My favourite colour is", n=8, seed=5,
                                                    max_tokens=16, extra_body={"guided_choice": colors})
        by_regex = await client.completions.create(model=MODEL, prompt="The code is", n=8, seed=5, max_tokens=16,
                                                   extra_body={"structured_outputs": {"regex": pattern}})
        return by_choice, by_regex

    by_choice, by_regex = run(main())
    assert [c.finish_reason for c in by_choice.choices] == ["stop"] * 8  # every choice ends within 16 tokens
    assert all(c.text in colors for c in by_choice.choices)
    assert [c.finish_reason for c in by_regex.choices] == ["stop"] * 8
    assert all(re.fullmatch(pattern, c.text) for c in by_regex.choices)


def test_a_grammar_that_cannot_finish_in_max_tokens_ends_with_length(client, run):
    async def main():
        return await client.completions.create(model=MODEL, prompt="x", max_tokens=5, seed=0,
                                               extra_body={"guided_regex": "(ab){40}"})

    choice = run(main()).choices[0]
    assert choice.finish_reason == "length" and re.fullmatch(r"(ab)*a?", choice.text) and choice.text


def deep(depth: int) -> dict:
    """An object schema holding ``depth`` objects, one in the next (2 JSON levels each)."""
    schema: dict = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


TOO_DEEP = "the JSON schema for structured outputs nests more than structured_output_max_depth=64 levels deep."


@pytest.mark.parametrize("path, body, reason", [
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}}}}, "'not'"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, "schema"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "(unclosed"}, "regex"),
    ("/v1/completions", {"prompt": "x", "guided_grammar": "root ::= undefined_rule"}, "grammar"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "if": {}}}}]}, "'if'"),
    # past the engine's bounds: the same sentence as on gRPC and the Python handle, whatever the field
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": deep(40)}}}, TOO_DEEP),
    ("/v1/completions", {"prompt": "x", "guided_json": deep(300)}, TOO_DEEP),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"json": '{"items": ' * 5000 + "{}" + "}" * 5000}}, TOO_DEEP),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": deep(40)}}], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     TOO_DEEP),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "maxLength": 100000}}}}, "structured_output_max_count=4096"),
])
def test_constraints_that_do_not_compile_are_400s_and_leave_the_engine_clean(http, llm, run, path, body, reason):
    error = assert_error(run(http.post(path, json=body)), 400)
    assert error["type"] == "invalid_request_error" and reason in error["message"]
    assert "\n" not in error["message"] and "Traceback" not in error["message"]
    run(until_clean(llm))


def test_constraint_errors_of_the_api_name_the_field(http, run):
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}
    error = assert_error(run(http.post("/v1/chat/completions", json=body)), 400, "tool_choice")
    assert "'x', which is not among the tools (get_weather, get_time)" in error["message"]
    body = {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}
    error = assert_error(run(http.post("/v1/completions", json=body)), 400)
    assert error["message"] == "give at most one output constraint, got 2: guided_regex, guided_choice"


def test_auto_tool_choice_reads_calls_and_tool_messages_are_accepted(client, run):
    """A conversation that went through a call and its result; with ``auto`` the nonsense the model
    writes is content (no call in it), and it finishes as an ordinary answer."""
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]

    async def main():
        return await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, seed=0,
                                                    max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})

    choice = run(main()).choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None and choice.message.content


def test_auto_tool_choice_reads_a_call_the_model_wrote(client, run):
    """With ``auto`` the server reads calls out of free text; here the text is held to the JSON call
    format by a schema, so that the random-weight model writes a call to parse."""
    call = {"type": "object", "properties": {"name": {"enum": ["get_weather"]}, "arguments": WEATHER},
            "required": ["name", "arguments"], "additionalProperties": False}

    async def main():
        return [await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, seed=seed, max_tokens=MAX_TOKENS,
            extra_body={"structured_outputs": {"json": call}}) for seed in SEEDS]

    finished = [r.choices[0] for r in run(main()) if r.choices[0].finish_reason == "tool_calls"]
    assert finished
    for choice in finished:
        check_calls(choice.message, parallel=False)
        assert choice.message.tool_calls[0].function.name == "get_weather"
