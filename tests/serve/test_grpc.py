"""The KVServe gRPC service (api/grpc_serving.py) on a plain grpc.aio server over an in-process AsyncLLM,
called through the generated stub: results equal the offline LLM's, streams add up to the unary result,
bad requests get INVALID_ARGUMENT, a cancelled stream frees its request, and the example client works.

The server and the engine live on an event loop in a background thread for the whole module; the tests
call them with the blocking stub. No Ray."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import NamedTuple

import grpc
import jsonschema
import pytest

from api import grpc_serving
from api import kvserve_pb2 as pb
from api import kvserve_pb2_grpc
from api.engine_client import AsyncLLMClient
from api.errors import ENGINE_DEAD_MESSAGE, INTERNAL_MESSAGE, OVERLOADED_MESSAGE, REQUEST_FAILED_MESSAGE
from engine import (LLM, AsyncLLM, EngineDeadError, EngineOverloadedError, RequestFailedError, SamplingParams,
                    engine_config)
from engine.messages import CompletionOutput, RequestOutput
from engine.sampling_params import StructuredOutputsParams
from engine.tokenizer import Tokenizer
from tests.e2e.prompts import test_prompts as make_prompts

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60
GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)


API_KEY = "sk-grpc-test"


class Server(NamedTuple):
    """The running server, its engine, and a blocking stub on a channel to it; a second server on the
    same engine is configured with ``API_KEY``."""

    address: str
    engine: AsyncLLM
    stub: kvserve_pb2_grpc.KVServeStub
    keyed_stub: kvserve_pb2_grpc.KVServeStub
    keyed_address: str


@pytest.fixture(scope="module")
def model_dir(model_dirs) -> str:
    return model_dirs["llama"]


@pytest.fixture(scope="module")
def offline(model_dir):
    with LLM(model=model_dir, num_kv_blocks=300) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(model_dir):
    engine = AsyncLLM(engine_config(model_dir, num_kv_blocks=300))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="grpc-test-loop", daemon=True)
    thread.start()

    async def start(api_key: str | None) -> tuple[grpc.aio.Server, int]:
        grpc_server = grpc.aio.server()
        servicer = grpc_serving.KVServeServicer(AsyncLLMClient(engine), engine.core.tokenizer, api_key)
        kvserve_pb2_grpc.add_KVServeServicer_to_server(servicer, grpc_server)
        port = grpc_server.add_insecure_port("127.0.0.1:0")
        await grpc_server.start()
        return grpc_server, port

    grpc_server, port = asyncio.run_coroutine_threadsafe(start(None), loop).result(TIMEOUT_S)
    keyed_server, keyed_port = asyncio.run_coroutine_threadsafe(start(API_KEY), loop).result(TIMEOUT_S)
    address = f"127.0.0.1:{port}"
    with grpc.insecure_channel(address) as channel, grpc.insecure_channel(f"127.0.0.1:{keyed_port}") as keyed:
        yield Server(address, engine, kvserve_pb2_grpc.KVServeStub(channel), kvserve_pb2_grpc.KVServeStub(keyed),
                     f"127.0.0.1:{keyed_port}")
    for running in (grpc_server, keyed_server):
        asyncio.run_coroutine_threadsafe(running.stop(None), loop).result(TIMEOUT_S)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(TIMEOUT_S)
    engine.shutdown()


def request(prompt: str | list[int], request_id: str = "", **params) -> pb.GenerateRequest:
    prompt_field = {"text": prompt} if isinstance(prompt, str) else {"token_ids": pb.TokenIds(ids=prompt)}
    return pb.GenerateRequest(**prompt_field, params=pb.SamplingParameters(**params), request_id=request_id)


def reference(offline, prompt: str | list[int], **params) -> RequestOutput:
    inputs = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    return offline.generate(inputs, SamplingParams(**params))[0]


def wait_until_clean(engine: AsyncLLM, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.stats()
        if stats["num_requests_running"] == stats["num_blocks_in_use"] == stats["num_requests_waiting"] == 0:
            return stats
        assert time.monotonic() < deadline, f"the engine still holds requests: {stats}"
        time.sleep(0.01)


def assert_matches(completion: pb.Completion, expected: CompletionOutput) -> None:
    assert (completion.text, list(completion.token_ids)) == (expected.text, expected.token_ids)
    assert completion.finish_reason == expected.finish_reason


def merge_stream(messages: list[pb.GenerateResponse]) -> dict[int, tuple[str, list[int], str]]:
    merged: dict[int, tuple[str, list[int], str]] = {}
    for message in messages:
        for c in message.completions:
            text, ids, reason = merged.get(c.index, ("", [], ""))
            merged[c.index] = (text + c.text, ids + list(c.token_ids), c.finish_reason or reason)
    return merged


def test_unary_text_prompt_equals_offline_greedy(server, offline):
    prompt = "The sky at sunset is"
    expected = reference(offline, prompt, **GREEDY)
    response = server.stub.Generate(request(prompt, "unary-1", **GREEDY), timeout=TIMEOUT_S)
    assert (response.request_id, len(response.completions)) == ("unary-1", 1)
    assert_matches(response.completions[0], expected.outputs[0])
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(expected.prompt_token_ids), 12)
    wait_until_clean(server.engine)


def test_token_id_prompt_and_server_made_request_id(server, offline, model_dir):
    prompt = make_prompts(model_dir)[2]
    expected = reference(offline, prompt, **GREEDY)
    response = server.stub.Generate(request(prompt, **GREEDY), timeout=TIMEOUT_S)
    assert response.request_id.startswith("grpc-")
    assert_matches(response.completions[0], expected.outputs[0])
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(prompt), 12)


def test_stream_adds_up_to_the_unary_result_with_usage_last(server, model_dir):
    prompt = make_prompts(model_dir)[6]  # 129 tokens: 8 full blocks
    unary = server.stub.Generate(request(prompt, **GREEDY), timeout=TIMEOUT_S)
    messages = list(server.stub.GenerateStream(request(prompt, "streamed", **GREEDY), timeout=TIMEOUT_S))
    assert len(messages) > 1 and all(m.request_id == "streamed" for m in messages)
    assert [m.HasField("usage") for m in messages] == [False] * (len(messages) - 1) + [True]
    assert all(c.finish_reason == "" for m in messages[:-1] for c in m.completions)
    c = unary.completions[0]
    assert merge_stream(messages) == {0: (c.text, list(c.token_ids), "length")}
    usage = messages[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (unary.usage.prompt_tokens, 12) == (129, 12)
    assert (unary.usage.cached_tokens, usage.cached_tokens) == (0, 128)  # the unary call cached 8 blocks


def test_n2_seeded_samples_equal_offline_unary_and_streamed(server, offline, model_dir):
    prompt = make_prompts(model_dir)[2]
    params = dict(n=2, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    expected = reference(offline, prompt, **params)
    response = server.stub.Generate(request(prompt, **params), timeout=TIMEOUT_S)
    assert [c.index for c in response.completions] == [0, 1]
    for completion, exp in zip(response.completions, expected.outputs):
        assert_matches(completion, exp)
    assert response.usage.completion_tokens == 16
    streamed = merge_stream(list(server.stub.GenerateStream(request(prompt, **params), timeout=TIMEOUT_S)))
    assert streamed == {c.index: (c.text, list(c.token_ids), c.finish_reason) for c in response.completions}


def test_logprobs_and_stop_token_id_as_offline(server, offline, model_dir):
    prompt = make_prompts(model_dir)[1]
    stop_id = reference(offline, prompt, **GREEDY).outputs[0].token_ids[4]
    params = dict(GREEDY, logprobs=2, stop_token_ids=[stop_id])
    expected = reference(offline, prompt, **params).outputs[0]
    completion = server.stub.Generate(request(prompt, **params), timeout=TIMEOUT_S).completions[0]
    assert_matches(completion, expected)
    assert (completion.finish_reason, completion.WhichOneof("stop_reason"), completion.stop_token_id) == \
        ("stop", "stop_token_id", stop_id)
    assert len(completion.logprobs) == len(expected.token_ids)
    for got, token_id, candidates in zip(completion.logprobs, expected.token_ids, expected.logprobs):
        assert got.token_id == token_id and got.logprob == pytest.approx(candidates[token_id])
        assert [t.token_id for t in got.top] == sorted(candidates, key=candidates.get, reverse=True)[:2]
        assert got.top[0].token_id == token_id  # greedy picks the most likely token


UINT32_MAX, INT32_MAX = 2**32 - 1, 2**31 - 1
OUT_OF_RANGE = {  # field values the proto types admit and the API refuses (api/limits.py)
    "n": (dict(n=UINT32_MAX), f"n must be an integer in [1, {INT32_MAX}], got {UINT32_MAX}"),
    "max_tokens": (dict(max_tokens=UINT32_MAX), f"max_tokens must be an integer in [1, {INT32_MAX}], got {UINT32_MAX}"),
    "min_tokens": (dict(min_tokens=2**31), f"min_tokens must be an integer in [0, {INT32_MAX}], got {2**31}"),
    "top_k": (dict(top_k=-2), f"top_k must be an integer in [-1, {INT32_MAX}], got -2"),
    "logprobs": (dict(logprobs=2**31), f"logprobs must be an integer in [0, {INT32_MAX}], got {2**31}"),
    "stop_token_ids": (dict(stop_token_ids=[3, UINT32_MAX]),
                       f"stop_token_ids must hold integers in [0, {INT32_MAX}], got {UINT32_MAX}"),
    "temperature_nan": (dict(temperature=float("nan")), "temperature must be a finite number in [0, 100], got nan"),
    "temperature_huge": (dict(temperature=1e300), "temperature must be a finite number in [0, 100], got 1e+300"),
    "top_p": (dict(top_p=2.0), "top_p must be a finite number in [1.1754943508222875e-38, 1], got 2.0"),
    "min_p_nan": (dict(min_p=float("nan")), "min_p must be a finite number in [0, 1], got nan"),
    "repetition_penalty_inf": (dict(repetition_penalty=float("inf")),
                               "repetition_penalty must be a finite number in [1.1754943508222875e-38, 100], got inf"),
    "presence_penalty": (dict(presence_penalty=-3.0), "presence_penalty must be a finite number in [-2, 2], got -3.0"),
    "frequency_penalty": (dict(frequency_penalty=float("-inf")),
                          "frequency_penalty must be a finite number in [-2, 2], got -inf"),
    # in range for the types, over the engine's caps (their defaults): the engine's sentence, unwrapped
    "max_n": (dict(n=20000, max_tokens=2), "n must be at most 128 (the engine's max_n), got 20000"),
    "max_stop_sequences": (dict(stop=[f"s{i}" for i in range(1000)]),
                           "at most 64 stop strings are allowed (the engine's max_stop_sequences), got 1000"),
    "max_logprobs": (dict(logprobs=21), "logprobs must be at most 20 (the engine's max_logprobs), got 21"),
    "max_stop_string_length": (dict(stop=["s" * 1025]), "a stop string may hold at most 1024 characters (the "
                                                        "engine's max_stop_string_length), got 1025"),
}


@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
@pytest.mark.parametrize("case", ["too_long", "no_prompt", "bad_token", "token_id_range", *OUT_OF_RANGE])
def test_bad_requests_are_invalid_argument(server, method, case):
    max_model_len = server.engine.core.config.max_model_len
    cases = {
        "too_long": (request([5] * (max_model_len + 1)), f"more than max_model_len={max_model_len}"),
        "no_prompt": (pb.GenerateRequest(), "no prompt"),
        "bad_token": (request([5, 10**6]), "prompt token ids must be in"),
        "token_id_range": (request([5, UINT32_MAX]), f"token_ids must hold integers in [0, {INT32_MAX}], got {UINT32_MAX}"),
    }
    cases.update({name: (request("Hello", **params), words) for name, (params, words) in OUT_OF_RANGE.items()})
    bad, words = cases[case]
    with pytest.raises(grpc.RpcError) as info:
        call = getattr(server.stub, method)(bad, timeout=TIMEOUT_S)
        list(call) if method == "GenerateStream" else call
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (words in info.value.details()) if case in ("too_long", "no_prompt", "bad_token") \
        else info.value.details() == words
    wait_until_clean(server.engine)


def test_cancelling_a_stream_aborts_the_engine_request(server, model_dir):
    before = server.engine.stats()["num_generation_tokens"]
    call = server.stub.GenerateStream(request(make_prompts(model_dir)[3], "leaver", temperature=0.0,
                                              max_tokens=1500, ignore_eos=True), timeout=TIMEOUT_S)
    for i, _ in enumerate(call):
        if i == 2:
            call.cancel()
            break
    with pytest.raises(grpc.RpcError) as info:
        next(call)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    stats = wait_until_clean(server.engine)
    assert stats["num_generation_tokens"] - before < 500  # ended, not run to its 1500 tokens
    # the id is free again
    assert server.stub.Generate(request("Hi", "leaver", max_tokens=2), timeout=TIMEOUT_S).request_id == "leaver"


@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
@pytest.mark.parametrize("metadata", [None, [("authorization", "Bearer wrong")], [("authorization", API_KEY)],
                                      [("authorization", f"Basic {API_KEY}")], [("x-api-key", API_KEY)]],
                         ids=["none", "wrong", "no-bearer", "basic", "other-header"])
def test_api_key_is_required_when_set(server, method, metadata):
    before = server.engine.stats()["num_generation_tokens"]
    with pytest.raises(grpc.RpcError) as info:
        call = getattr(server.keyed_stub, method)(request("Hello", **GREEDY), metadata=metadata, timeout=TIMEOUT_S)
        list(call) if method == "GenerateStream" else call
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert info.value.details() == "invalid or missing API key: send the metadata `authorization: Bearer <key>`"
    assert server.engine.stats()["num_generation_tokens"] == before  # nothing ran


def test_the_right_api_key_is_served_as_without_a_key(server, offline):
    expected = reference(offline, "The sky at sunset is", **GREEDY).outputs[0]
    metadata = [("authorization", f"Bearer {API_KEY}")]
    unary = server.keyed_stub.Generate(request("The sky at sunset is", **GREEDY), metadata=metadata, timeout=TIMEOUT_S)
    assert_matches(unary.completions[0], expected)
    streamed = list(server.keyed_stub.GenerateStream(request("The sky at sunset is", **GREEDY), metadata=metadata,
                                                     timeout=TIMEOUT_S))
    assert merge_stream(streamed) == {0: (expected.text, expected.token_ids, "length")}


def test_example_client_against_the_server(server, offline):
    expected = reference(offline, "Hello", temperature=0.0, max_tokens=8).outputs[0].text
    for extra in ([], ["--stream", "--app", "kvserve"]):
        out = subprocess.run(
            [sys.executable, "-m", "api.grpc_client_example", "--address", server.address, "--prompt", "Hello",
             "--max-tokens", "8", "--temperature", "0", *extra],
            cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
        assert out.returncode == 0, out.stderr
        assert out.stdout == expected + "\n"
        assert "completion_tokens=" in out.stderr
    base = [sys.executable, "-m", "api.grpc_client_example", "--address", server.keyed_address, "--prompt", "Hello",
            "--max-tokens", "8", "--temperature", "0"]
    for extra, env_key, code in (([], None, 1), (["--api-key", "nope"], None, 1), (["--api-key", API_KEY], None, 0),
                                 ([], API_KEY, 0)):
        env = {k: v for k, v in os.environ.items() if k != "KVSERVE_API_KEY"}
        if env_key is not None:
            env["KVSERVE_API_KEY"] = env_key
        out = subprocess.run(base + extra, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
        assert out.returncode == code, out.stderr
        assert out.stdout == (expected + "\n" if code == 0 else "")
        assert ("UNAUTHENTICATED" in out.stderr) == (code == 1)


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


# --- the service logic alone, on a fake engine client -------------------------------------------------


class FakeClient:
    """Streams one token per step forever, or raises ``error`` at once; records aborts."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.aborted: list[str] = []

    async def generate(self, request_id, prompt_token_ids, params, cache_salt) -> AsyncIterator[RequestOutput]:
        if self.error is not None:
            raise self.error
        for step in range(10**6):
            yield RequestOutput(request_id, None, prompt_token_ids, [CompletionOutput(0, "x", [step])], False)
            await asyncio.sleep(0)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


class FakeServeContext:
    """Duck type of Ray Serve's RayServegRPCContext: set_code / set_details, the client's metadata, no abort."""

    code = details = None

    def __init__(self, metadata: list[tuple[str, str]] | None = None) -> None:
        self.metadata = metadata or []

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self.metadata

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer(model_dir)


def test_consumer_leaving_aborts_but_an_engine_refusal_does_not(tokenizer):
    async def main() -> None:
        client = FakeClient()
        stream = grpc_serving.generate_stream(request([1, 2], "left"), client, tokenizer)
        assert (await stream.__anext__()).completions[0].token_ids == [0]
        await stream.aclose()
        [left] = client.aborted  # the engine's id, made by the server: the client's "left" is a label
        assert left.startswith("grpc-")

        client = FakeClient()
        task = asyncio.ensure_future(grpc_serving.generate(request([1, 2], "cancelled"), client, tokenizer))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(client.aborted) == 1 and client.aborted[0].startswith("grpc-")

        refusing = FakeClient(ValueError("request id 'taken' is empty or already in use"))
        with pytest.raises(ValueError):
            await grpc_serving.generate(request([1, 2], "taken"), refusing, tokenizer)
        assert refusing.aborted == []  # an abort would hit the other request that holds the id

    asyncio.run(main())


def ray_task_error(cause: Exception) -> Exception:
    """Ray's RayTaskError(X) as a Serve handle call raises it: an instance of the cause's class whose
    text is a coloured traceback with the task name, pid and IP."""
    from ray.exceptions import RayTaskError

    try:
        raise cause
    except Exception as exc:
        traceback = "".join(__import__("traceback").format_exception(exc))
        error = RayTaskError("ServeReplica:kvserve:Ingress.Generate", traceback, exc, pid=4242, ip="10.1.2.3")
    return error.as_instanceof_cause()


@pytest.mark.parametrize("method", ["generate", "generate_stream"])
@pytest.mark.parametrize("error, code, details", [
    (ValueError("top_p must be in (0, 1], got 2.0"), grpc.StatusCode.INVALID_ARGUMENT, "top_p must be in (0, 1], got 2.0"),
    (ray_task_error(ValueError("bad stop id")), grpc.StatusCode.INVALID_ARGUMENT, "bad stop id"),
    (EngineOverloadedError("8 requests waiting"), grpc.StatusCode.RESOURCE_EXHAUSTED, OVERLOADED_MESSAGE),
    (ray_task_error(EngineOverloadedError("8 requests waiting")), grpc.StatusCode.RESOURCE_EXHAUSTED,
     OVERLOADED_MESSAGE),
    (ray_task_error(EngineDeadError("engine step failed: ActorDiedError('actor 5f2a9c0e, pid=4242')")),
     grpc.StatusCode.UNAVAILABLE, ENGINE_DEAD_MESSAGE),
    (RuntimeError("boom"), grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE),
    (ray_task_error(RuntimeError("boom at 10.1.2.3")), grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE),
    (RuntimeError("\x1b[31mred\x1b[0m alert"), grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE),
])
def test_errors_on_a_serve_context_set_the_code_and_reraise(tokenizer, method, error, code, details):
    context = FakeServeContext()

    async def main() -> None:
        if method == "generate":
            await grpc_serving.generate(request([1, 2]), FakeClient(error), tokenizer, context)
        else:
            async for _ in grpc_serving.generate_stream(request([1, 2]), FakeClient(error), tokenizer, context):
                pass

    with pytest.raises(type(error)):
        asyncio.run(main())
    assert (context.code, context.details) == (code, details)


@pytest.mark.parametrize("method", ["generate", "generate_stream"])
def test_api_key_on_a_serve_context(tokenizer, method):
    """Behind Serve's proxy the metadata arrives on RayServegRPCContext: a bad key sets UNAUTHENTICATED
    and raises before the engine sees the request; the right key is served; no context is not checked."""
    class ThreeTokens(FakeClient):
        async def generate(self, request_id, prompt_token_ids, params, cache_salt):
            self.calls = getattr(self, "calls", 0) + 1
            for step in range(3):
                yield RequestOutput(request_id, None, prompt_token_ids, [CompletionOutput(0, "x", [step])], step == 2)

    async def call(context, api_key="k") -> list[pb.GenerateResponse]:
        client = ThreeTokens()
        try:
            if method == "generate":
                return [await grpc_serving.generate(request([1, 2]), client, tokenizer, context, api_key=api_key)]
            return [m async for m in grpc_serving.generate_stream(request([1, 2]), client, tokenizer, context,
                                                                  api_key=api_key)]
        finally:
            assert getattr(client, "calls", 0) == (0 if context is refused else 1)

    refused = FakeServeContext([("application", "kvserve"), ("authorization", "Bearer nope")])
    with pytest.raises(grpc_serving.Unauthenticated):
        asyncio.run(call(refused))
    assert refused.code == grpc.StatusCode.UNAUTHENTICATED
    accepted = FakeServeContext([("authorization", "Bearer k")])
    responses = asyncio.run(call(accepted))
    assert accepted.code is None and [t for r in responses for c in r.completions for t in c.token_ids] == [0, 1, 2]
    assert asyncio.run(call(None))  # an in-cluster Python call
    assert asyncio.run(call(FakeServeContext(), api_key=None))  # no key configured


def test_a_request_the_engine_failed_alone_is_internal_with_a_fixed_sentence():
    error = RequestFailedError("the engine failed while running this request (IndexError: at 0x7f00)")
    assert grpc_serving.grpc_status(error) == (grpc.StatusCode.INTERNAL, REQUEST_FAILED_MESSAGE)
