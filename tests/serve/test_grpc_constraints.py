"""Output constraints over gRPC (api/grpc_serving.py): the constraint oneof becomes structured outputs, choice,
regex and JSON schema constraints hold unary and streamed, and constraints that do not compile are INVALID_ARGUMENT."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import grpc
import jsonschema
import pytest

from api import grpc_serving
from api import kvserve_pb2 as pb
from engine.sampling_params import StructuredOutputsParams
from tests.serve.grpc_harness import (  # noqa: F401 (model_dir, offline, server: fixtures)
    ROOT,
    TIMEOUT_S,
    merge_stream,
    model_dir,
    request,
    server,
    wait_until_clean,
)

# --- output constraints --------------------------------------------------------------------------------

COLORS = ["red", "green", "dark blue"]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.mark.parametrize("params, expected", [
    (dict(), None),
    (dict(json_schema=json.dumps(SCHEMA)), StructuredOutputsParams(json=SCHEMA)),
    (dict(json_object=True), StructuredOutputsParams(json_object=True)),
    (dict(json_object=False), None),
    (dict(regex="[a-z]+"), StructuredOutputsParams(regex="[a-z]+")),
    (dict(choice=pb.Choices(choices=COLORS)), StructuredOutputsParams(choice=tuple(COLORS))),
    (dict(grammar='root ::= "a"'), StructuredOutputsParams(grammar='root ::= "a"')),
])
def test_the_constraint_oneof_becomes_structured_outputs(params, expected):
    assert grpc_serving.sampling_params_from_proto(pb.SamplingParameters(**params)).structured_outputs == expected


def test_choice_regex_and_json_schema_constraints_hold(server):
    def outputs(**params) -> list[pb.Completion]:
        unary = server.stub.Generate(request("Pick:", n=6, seed=7, max_tokens=48, **params), timeout=TIMEOUT_S)
        streamed = merge_stream(list(server.stub.GenerateStream(
            request("Pick:", n=6, seed=7, max_tokens=48, **params), timeout=TIMEOUT_S)))
        assert {c.index: (c.text, list(c.token_ids), c.finish_reason) for c in unary.completions} == streamed
        return list(unary.completions)

    chosen = outputs(choice=pb.Choices(choices=COLORS))
    assert [c.finish_reason for c in chosen] == ["stop"] * 6 and all(c.text in COLORS for c in chosen)
    matched = outputs(regex=r"[ab]{1,3}\.[0-9]")
    assert [c.finish_reason for c in matched] == ["stop"] * 6
    assert all(re.fullmatch(r"[ab]{1,3}\.[0-9]", c.text) for c in matched)
    stopped = [c for c in outputs(json_schema=json.dumps(SCHEMA)) if c.finish_reason == "stop"]
    assert stopped
    for completion in stopped:
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    wait_until_clean(server.engine)


TOO_DEEP = "the JSON schema for structured outputs nests more than structured_output_max_depth=64 levels deep."


@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
@pytest.mark.parametrize("params, words", [
    (dict(json_schema="{not json"), "json_schema is not valid JSON: "),
    (dict(json_schema="[1]"), "json_schema must be a JSON schema (a JSON object), got list"),
    (dict(json_schema=json.dumps({"type": "object", "not": {}})), "'not'"),
    (dict(regex="(unclosed"), "regex"),
    (dict(grammar="root ::= undefined_rule"), "grammar"),
    (dict(choice=pb.Choices()), "structured output choice must hold at least one string"),
    # nested past structured_output_max_depth (64), and past what json.loads could read (a RecursionError)
    (dict(json_schema='{"items": ' * 70 + "{}" + "}" * 70), TOO_DEEP),
    (dict(json_schema='{"items": ' * 5000 + "{}" + "}" * 5000), TOO_DEEP),
])
def test_constraints_that_do_not_compile_are_invalid_argument(server, method, params, words):
    with pytest.raises(grpc.RpcError) as info:
        call = getattr(server.stub, method)(request("Hello", **params), timeout=TIMEOUT_S)
        list(call) if method == "GenerateStream" else call
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in info.value.details() and "\n" not in info.value.details()
    wait_until_clean(server.engine)


def test_example_client_sends_a_constraint(server):
    out = subprocess.run([sys.executable, "-m", "api.grpc_client_example", "--address", server.address,
                          "--prompt", "Pick:", "--seed", "1", "--choice", "yes", "--choice", "no"],
                         cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stderr
    assert out.stdout in ("yes\n", "no\n") and "finish_reason=stop" in out.stderr
