"""What each structured-output and tool request shape turns into (``SamplingParams.structured_outputs``,
the template's tools and messages), and the 400s of the shapes that cannot be served. No engine."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from api.openai_chat_protocol import ChatCompletionRequest
from api.openai_protocol import CompletionRequest
from engine.sampling_params import StructuredOutputsParams

USER = [{"role": "user", "content": "x"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "time"}}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "x", **fields})


def constraint(request) -> StructuredOutputsParams | None:
    return request.to_sampling_params().structured_outputs


@pytest.mark.parametrize("make", [chat, completion])
@pytest.mark.parametrize("fields, expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"json": '{"type": "integer"}'}}, StructuredOutputsParams(json='{"type": "integer"}')),
    ({"structured_outputs": {"regex": "[ab]+"}}, StructuredOutputsParams(regex="[ab]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputsParams(choice=("yes", "no"))),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutputsParams(grammar='root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputsParams(json_object=True)),
    ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
    ({"guided_regex": "\\d{3}"}, StructuredOutputsParams(regex="\\d{3}")),
    ({"guided_choice": ["red", "blue"]}, StructuredOutputsParams(choice=("red", "blue"))),
    ({"guided_grammar": 'root ::= "b"'}, StructuredOutputsParams(grammar='root ::= "b"')),
])
def test_each_constraint_field_becomes_its_structured_outputs(make, fields, expected):
    assert constraint(make(**fields)) == expected


@pytest.mark.parametrize("make", [chat, completion])
@pytest.mark.parametrize("fields, named", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format, guided_regex"),
    ({"structured_outputs": {"choice": ["a"]}, "guided_choice": ["b"]}, "structured_outputs, guided_choice"),
    ({"guided_json": SCHEMA, "guided_grammar": "root ::= \"a\"", "guided_regex": "a"},
     "guided_json, guided_regex, guided_grammar"),
])
def test_two_constraints_at_once_are_refused_naming_them(make, fields, named):
    with pytest.raises(ValidationError) as info:
        make(**fields)
    assert f"give at most one output constraint, got {len(named.split(', '))}: {named}" in str(info.value)


@pytest.mark.parametrize("fields, message", [
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of json, json_object, regex, choice"),
    ({"structured_outputs": {}}, "got none"),
    ({"structured_outputs": {"choice": []}}, "at least one string"),
    ({"guided_choice": []}, "at least 1 item"),
    ({"response_format": {"type": "json_schema"}}, "needs json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "needs json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "'text', 'json_object' or 'json_schema'"),
    ({"guided_json": 5}, "guided_json"),
])
def test_malformed_constraints_are_refused(fields, message):
    with pytest.raises(ValidationError) as info:
        completion(**fields)
    assert message in str(info.value)


def test_required_tool_choice_constrains_to_an_array_of_calls_one_schema_per_tool():
    schema = constraint(chat(tools=TOOLS, tool_choice="required")).json
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    weather, time = schema["items"]["anyOf"]
    assert weather["properties"] == {"name": {"type": "string", "enum": ["weather"]}, "arguments": WEATHER}
    assert time["properties"] == {"name": {"type": "string", "enum": ["time"]},
                                  "arguments": {"type": "object", "properties": {}}}
    for item in (weather, time):
        assert item["required"] == ["name", "arguments"] and item["additionalProperties"] is False


def test_required_without_parallel_calls_takes_exactly_one_call_and_one_tool_needs_no_anyof():
    schema = constraint(chat(tools=TOOLS[:1], tool_choice="required", parallel_tool_calls=False)).json
    assert (schema["minItems"], schema["maxItems"]) == (1, 1)
    assert schema["items"]["properties"]["arguments"] == WEATHER


def test_required_tool_choice_moves_the_tools_definitions_to_the_root_where_references_find_them():
    address = {"type": "object", "properties": {"city": {"type": "string"}}}
    save = {"$defs": {"Addr": address}, "type": "object", "properties": {"home": {"$ref": "#/$defs/Addr"}}}
    legacy = {"definitions": {"Zone": {"enum": [1, 2]}}, "type": "object",
              "properties": {"zone": {"$ref": "#/definitions/Zone"}}}
    tools = [{"type": "function", "function": {"name": "save", "parameters": save}},
             {"type": "function", "function": {"name": "move", "parameters": legacy}},
             {"type": "function", "function": {"name": "copy", "parameters": save}}]
    schema = constraint(chat(tools=tools, tool_choice="required")).json
    assert schema["$defs"] == {"Addr": address} and schema["definitions"] == {"Zone": {"enum": [1, 2]}}
    arguments = [item["properties"]["arguments"] for item in schema["items"]["anyOf"]]
    assert arguments == [{"type": "object", "properties": {"home": {"$ref": "#/$defs/Addr"}}},
                         {"type": "object", "properties": {"zone": {"$ref": "#/definitions/Zone"}}},
                         {"type": "object", "properties": {"home": {"$ref": "#/$defs/Addr"}}}]
    assert save["$defs"] == {"Addr": address}  # the request's own schema is left as it was
    other = {"$defs": {"Addr": {"type": "string"}}, "type": "object", "properties": {}}
    clash = tools[:1] + [{"type": "function", "function": {"name": "other", "parameters": other}}]
    with pytest.raises(ValidationError, match="the tools define \\$defs/Addr differently"):
        chat(tools=clash, tool_choice="required")


def test_a_named_tool_choice_constrains_to_that_functions_arguments():
    request = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "weather"}})
    assert constraint(request) == StructuredOutputsParams(json=WEATHER)
    request = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "time"}})
    assert constraint(request) == StructuredOutputsParams(json={"type": "object", "properties": {}})


@pytest.mark.parametrize("tool_choice", [None, "auto", "none"])
def test_auto_and_none_tool_choices_leave_the_output_free(tool_choice):
    request = chat(tools=TOOLS, tool_choice=tool_choice)
    assert constraint(request) is None
    assert request.effective_tool_choice == (tool_choice or "auto")
    assert request.tools_for_template() == TOOLS


def test_auto_tools_take_a_response_format_and_required_ones_do_not():
    request = chat(tools=TOOLS, response_format={"type": "json_object"})
    assert constraint(request) == StructuredOutputsParams(json_object=True)
    with pytest.raises(ValidationError, match="got 2: response_format, tool_choice"):
        chat(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})


@pytest.mark.parametrize("fields, message", [
    ({"tool_choice": "required"}, "tool_choice is only allowed when tools are given"),
    ({"tool_choice": "none"}, "tool_choice is only allowed when tools are given"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice names the function 'nope', which is not among the tools (weather, time)"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "'none', 'auto' or 'required'"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "two tools are named 'weather'"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "a function name is 1 to 64"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "parameters"),
    ({"tools": [{"type": "function"}]}, "function"),
])
def test_bad_tool_requests_are_refused(fields, message):
    with pytest.raises(ValidationError) as info:
        chat(**fields)
    assert message in str(info.value)


def test_tool_messages_reach_the_template_with_decoded_arguments():
    request = ChatCompletionRequest.model_validate({"tools": TOOLS, "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "time", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
    assert [m.for_template() for m in request.messages] == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}},
            {"id": "call_2", "type": "function", "function": {"name": "time", "arguments": "not json"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]


def nested_objects(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("fields", [
    dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": nested_objects(300)}}),
    dict(structured_outputs={"json": nested_objects(300)}),
    dict(tools=[{"type": "function", "function": {"name": "f", "parameters": nested_objects(300)}}],
         tool_choice={"type": "function", "function": {"name": "f"}}),
    dict(tools=[{"type": "function", "function": {"name": "f", "parameters": nested_objects(300)}}],
         tool_choice="required"),
])
def test_a_schema_deeper_than_any_engine_allows_travels_as_text_the_engine_refuses(fields):
    """600 levels: pickling the dict to the engine's process would raise RecursionError (a 500); as
    text it travels, and the engine's depth bound refuses it with its usual sentence."""
    import pickle

    from engine.structured_bounds import StructuredOutputBounds

    params = chat(**fields).output_constraint()
    assert isinstance(params.json, str) and pickle.loads(pickle.dumps(params)).json == params.json
    with pytest.raises(ValueError, match=r"^the JSON schema for structured outputs nests more than "
                                         r"structured_output_max_depth=64 levels deep\.$"):
        StructuredOutputBounds().check("json", params.json)
