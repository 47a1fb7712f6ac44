"""What a request's structured-output fields constrain the generation to, as one
``StructuredOutputsParams``, and the JSON schemas of constrained tool calls.

    response_format {"type": "json_object"}                         → json_object
    response_format {"type": "json_schema", "json_schema": {...}}   → json (the schema)
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object": ...}   (vLLM)
    guided_json, guided_regex, guided_choice, guided_grammar                             (vLLM, older names)
    tool_choice "required"                  → json: an array of calls, one item schema per tool
    tool_choice {"type": "function", ...}   → json: that function's arguments

At most one of them may be given; two are a ValueError naming both (HTTP 400). Whether a schema,
regex or grammar compiles is the engine's to say, at admission (a ValueError with the library's reason).
"""

from __future__ import annotations

import json as _json
from typing import Any

from engine.config import STRUCTURED_OUTPUT_DEPTH_CEILING
from engine.sampling_params import StructuredOutputsParams

# a function without "parameters" takes no arguments (as OpenAI reads it)
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def tool_parameters(function: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of a function's arguments (an object schema; none given: no arguments)."""
    parameters = function.get("parameters")
    return dict(EMPTY_PARAMETERS) if parameters is None else parameters


_DEFINITIONS = ("$defs", "definitions")  # where a schema keeps the subschemas its "#/..." references name


def required_calls_schema(functions: list[dict[str, Any]], parallel_tool_calls: bool) -> dict[str, Any]:
    """The schema of ``tool_choice: "required"``: a JSON array of ``{"name": ..., "arguments": ...}``,
    each item one of the tools (``anyOf``, the name a one-value enum so that the arguments follow
    their tool's schema), at least one item, exactly one without ``parallel_tool_calls``.

    A tool's ``$defs`` (or ``definitions``) move to the root of this schema, where its references
    (``#/$defs/...``, relative to the document's root) find them; two tools defining one name
    differently are a ValueError."""
    definitions: dict[str, dict[str, Any]] = {key: {} for key in _DEFINITIONS}
    items = []
    for function in functions:
        parameters = tool_parameters(function)
        if isinstance(parameters, dict) and any(key in parameters for key in _DEFINITIONS):
            parameters = dict(parameters)
            for key in _DEFINITIONS:
                for name, definition in (parameters.pop(key, None) or {}).items():
                    if definitions[key].setdefault(name, definition) != definition:
                        raise ValueError(f"the tools define {key}/{name} differently; with tool_choice "
                                         "\"required\" their definitions share one schema, so rename one")
        items.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [function["name"]]}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items},
                              "minItems": 1}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    schema.update({key: found for key, found in definitions.items() if found})
    return schema


def constraint_of(given: dict[str, StructuredOutputsParams | None]) -> StructuredOutputsParams | None:
    """The one constraint among the request fields that set one (field name → its constraint or
    None); ValueError naming the fields when more than one does."""
    named = {name: value for name, value in given.items() if value is not None}
    if len(named) > 1:
        raise ValueError(f"give at most one output constraint, got {len(named)}: {', '.join(named)}")
    return next(iter(named.values()), None)


def json_depth(value) -> int:
    """How deeply a parsed JSON value nests (objects and arrays), counted without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def transportable(schema):
    """A schema as it travels to the engine: a schema nested deeper than any engine allows goes as its
    JSON text (pickling it whole could exceed the recursion limit on the way), which the engine's
    depth bound then refuses with the same sentence as any schema too deep for it."""
    if isinstance(schema, (dict, list)) and json_depth(schema) > STRUCTURED_OUTPUT_DEPTH_CEILING:
        try:
            return _json.dumps(schema)
        except RecursionError:  # deeper than even the text can be written: a text just as refused
            return "[" * (STRUCTURED_OUTPUT_DEPTH_CEILING + 1)
    return schema


def from_response_format(kind: str, schema: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """``response_format`` of type "text" (no constraint), "json_object" or "json_schema"."""
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        return StructuredOutputsParams(json=transportable(schema))
    return None


def from_fields(json: dict | str | None = None, regex: str | None = None, choice: list[str] | None = None,
                grammar: str | None = None, json_object: bool | None = None) -> StructuredOutputsParams:
    """vLLM's ``structured_outputs`` object: exactly one of its fields (ValueError otherwise)."""
    return StructuredOutputsParams(json=transportable(json), regex=regex, choice=None if choice is None else tuple(choice),
                                   grammar=grammar, json_object=bool(json_object))
