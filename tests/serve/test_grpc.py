"""The KVServe gRPC service (api/grpc_serving.py) on a plain grpc.aio server over an in-process AsyncLLM,
called through the generated stub: results equal the offline LLM's, streams add up to the unary result,
bad requests get INVALID_ARGUMENT, a cancelled stream frees its request, and the example client works.

The server and the engine live on an event loop in a background thread for the whole module; the tests
call them with the blocking stub (tests/serve/grpc_harness.py). No Ray. Output constraints:
test_grpc_constraints.py; the service logic alone on a fake engine client: test_grpc_service.py."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest

from api import kvserve_pb2 as pb
from tests.e2e.prompts import test_prompts as make_prompts
from tests.serve.grpc_harness import (  # noqa: F401 (model_dir, offline, server: fixtures)
    API_KEY,
    GREEDY,
    ROOT,
    TIMEOUT_S,
    assert_matches,
    merge_stream,
    model_dir,
    offline,
    reference,
    request,
    server,
    wait_until_clean,
)


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
