"""Request errors of the OpenAI-compatible HTTP API: every one has the OpenAI error body and its status
(400 bad input, 401 key, 404 model, 503 full queue), and a bad request leaves its neighbours intact (failures
inside the engine: test_openai_engine_failures.py; clients that leave: test_openai_disconnects.py)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.serve.openai_harness import (GREEDY, MODEL, app, assert_error, client, http, llm,  # noqa: F401
                                        model_dir, offline, parse_metrics, prompts, reference, run, until_clean)


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1.0}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "suffix": "!"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ("/v1/completions", {"prompt": [4096]}, None),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": ["text", [1, 2]]}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"},
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, None),
])
def test_bad_requests_get_400_with_an_openai_error_body(http, run, path, body, param):
    error = assert_error(run(http.post(path, json=body)), 400, param)
    assert error["type"] == "invalid_request_error"


CHAT = {"messages": [{"role": "user", "content": "x"}]}
INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "top_k": 2**63},
     "top_k", f"top_k: Input should be less than or equal to {INT32_MAX}"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, "top_k", "top_k: Input should be greater than or equal to -1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2**64}, "max_tokens",
     f"max_tokens: Input should be less than or equal to {INT32_MAX}"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n", "n: Input should be greater than or equal to 1"),
    ("/v1/completions", {"prompt": "x", "n": 2**40}, "n", f"n: Input should be less than or equal to {INT32_MAX}"),
    ("/v1/completions", {"prompt": "x", "seed": 2**63}, "seed",
     f"seed: Input should be less than or equal to {INT64_MAX}"),
    ("/v1/completions", {"prompt": "x", "seed": -(2**63) - 1}, "seed",
     f"seed: Input should be greater than or equal to {-(2**63)}"),
    ("/v1/completions", {"prompt": "x", "min_tokens": -1}, "min_tokens",
     "min_tokens: Input should be greater than or equal to 0"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs",
     "logprobs: Input should be greater than or equal to 0"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [2, 2**64]}, "stop_token_ids",
     f"stop_token_ids.1: Input should be less than or equal to {INT32_MAX}"),
    ("/v1/completions", {"prompt": [1, 2**64]}, "prompt",
     f"prompt: token ids must be integers in [0, {INT32_MAX}], got {2**64}"),
    ("/v1/completions", {"prompt": [5] * 20 + [2**64] + [5] * 20, "max_tokens": 2}, "prompt",  # inside a full block
     f"prompt: token ids must be integers in [0, {INT32_MAX}], got {2**64}"),
    ("/v1/completions", {"prompt": [[1, 2], [-1]]}, "prompt",
     f"prompt: token ids must be integers in [0, {INT32_MAX}], got -1"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p", "top_p: Input should be greater than or equal to 1.1754943508222875e-38"),
    ("/v1/completions", {"prompt": "x", "top_p": 1e-46}, "top_p",  # 0 in float32 on the workers
     "top_p: Input should be greater than or equal to 1.1754943508222875e-38"),
    ("/v1/completions", {"prompt": "x", "min_p": 1.5}, "min_p", "min_p: Input should be less than or equal to 1"),
    ("/v1/completions", {"prompt": "x", "temperature": 1e300}, "temperature",
     "temperature: Input should be less than or equal to 100"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty",
     "presence_penalty: Input should be less than or equal to 2"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty",
     "frequency_penalty: Input should be greater than or equal to -2"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty",
     "repetition_penalty: Input should be greater than or equal to 1.1754943508222875e-38"),
    ("/v1/chat/completions", {**CHAT, "repetition_penalty": 1e-40}, "repetition_penalty",
     "repetition_penalty: Input should be greater than or equal to 1.1754943508222875e-38"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 2**63}, "max_completion_tokens",
     f"max_completion_tokens: Input should be less than or equal to {INT32_MAX}"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2**70}, "top_logprobs",
     f"top_logprobs: Input should be less than or equal to {INT32_MAX}"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "top_logprobs must be at most 20 (the server's max_logprobs), got 21"),
    ("/v1/chat/completions", {**CHAT, "top_k": 2**63}, "top_k",
     f"top_k: Input should be less than or equal to {INT32_MAX}"),
    ("/v1/chat/completions", {**CHAT, "repetition_penalty": 1e9}, "repetition_penalty",
     "repetition_penalty: Input should be less than or equal to 100"),
])
def test_numbers_out_of_range_get_400_naming_the_field(http, run, path, body, param, message):
    error = assert_error(run(http.post(path, json=body)), 400, param)
    assert (error["message"], error["type"], error["code"]) == (message, "invalid_request_error", 400)


@pytest.mark.parametrize("field, literal", [("temperature", "NaN"), ("top_p", "NaN"), ("temperature", "Infinity"),
                                            ("repetition_penalty", "Infinity"), ("min_p", "-Infinity"),
                                            ("presence_penalty", "NaN"), ("frequency_penalty", "Infinity")])
def test_nan_and_infinity_get_400(http, run, field, literal):
    """Python's JSON reader takes NaN and Infinity literals; no float field lets them through."""
    for path, body in (("/v1/completions", '{"prompt": "x", "%s": %s}'),
                       ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "%s": %s}')):
        response = run(http.post(path, content=(body % (field, literal)).encode(),
                                 headers={"Content-Type": "application/json"}))
        assert assert_error(response, 400, field)["message"] == f"{field}: Input should be a finite number"


def test_an_out_of_range_top_k_fails_alone_beside_a_good_request(client, http, offline, llm, run):
    """The request of the report: refused at the API, while a good one beside it completes exactly."""
    expected = reference(offline, "The sky at sunset is", temperature=0.0, max_tokens=12, ignore_eos=True).text

    async def main():
        good = asyncio.ensure_future(client.completions.create(model=MODEL, prompt="The sky at sunset is",
                                                               max_tokens=12, **GREEDY))
        await asyncio.sleep(0.05)  # running when the bad one arrives
        bad = await http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "top_k": 2**63})
        return bad, await good

    bad, good = run(main())
    assert_error(bad, 400, "top_k")
    assert (good.choices[0].text, good.choices[0].finish_reason) == (expected, "length")
    run(until_clean(llm))


LONE = "\\ud800"  # as the JSON text carries it: a lone surrogate once parsed
TEXT_ERROR = "must be valid Unicode text: it holds a lone surrogate code point, which UTF-8 cannot encode"


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", '{"prompt": "a%sb"}', "prompt"),
    ("/v1/completions", '{"prompt": ["fine", "%s"]}', "prompt"),
    ("/v1/completions", '{"prompt": "x", "stop": ["%s"]}', "stop"),
    ("/v1/completions", '{"prompt": "x", "stop": "%s"}', "stop"),
    ("/v1/completions", '{"prompt": "x", "model": "%s"}', "model"),
    ("/v1/completions", '{"prompt": "x", "cache_salt": "%s"}', "cache_salt"),
    ("/v1/completions", '{"prompt": "x", "user": "%s"}', "user"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "%s"}]}', "messages.0.content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}]}',
     "messages.0.content.0.text"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x", "name": "%s"}]}', "messages.0.name"),
    ("/tokenize", '{"prompt": "%s"}', "prompt"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "%s"}]}', "messages.0.content"),
])
def test_lone_surrogates_get_400_naming_the_field(http, run, path, body, field):
    response = run(http.post(path, content=(body % LONE).encode(), headers={"Content-Type": "application/json"}))
    error = assert_error(response, 400, field.split(".")[0])
    assert error["message"] == f"{field}: {TEXT_ERROR}"


def test_a_lone_surrogate_in_a_field_name_or_role_gets_400(http, run):
    """Where the client's text ends up in the message (a dict key) it is made valid UTF-8; a bad role is refused."""
    raw = {"Content-Type": "application/json"}
    bias = run(http.post("/v1/completions", content=('{"prompt": "x", "logit_bias": {"%s": "a"}}' % LONE).encode(),
                         headers=raw))
    key, _, message = assert_error(bias, 400, "logit_bias")["message"].partition(": ")
    assert key.startswith("logit_bias.") and message == "Input should be a valid number, unable to parse string as a number"
    role = run(http.post("/v1/chat/completions", headers=raw,
                         content=('{"messages": [{"role": "%s", "content": "x"}]}' % LONE).encode()))
    assert assert_error(role, 400, "messages")["message"].startswith("messages.0.role: ")


def test_malformed_json_and_too_long_prompts_get_400(http, run):
    malformed = run(http.post("/v1/completions", content=b'{"prompt": "x",',
                              headers={"Content-Type": "application/json"}))
    assert "malformed JSON" in assert_error(malformed, 400)["message"]
    too_long = run(http.post("/v1/completions", json={"prompt": [5] * 2049, "max_tokens": 1}))
    assert "maximum context length" in assert_error(too_long, 400, "prompt")["message"]
    no_room = {"prompt": [5] * 2000, "max_tokens": 100, "stream": True}
    assert_error(run(http.post("/v1/completions", json=no_room)), 400, "max_tokens")
    chat = {"messages": [{"role": "user", "content": "word " * 3000}]}
    assert_error(run(http.post("/v1/chat/completions", json=chat)), 400, "messages")


def test_one_model_and_the_version(http, run):
    """/v1/models/{id} answers the served model's card (the same as in the list), any other id a 404;
    /version the installed package's version, without a key."""
    import importlib.metadata

    async def main():
        return (await http.get("/v1/models"), await http.get(f"/v1/models/{MODEL}"), await http.get("/v1/models/x/y"),
                await http.get("/version"))

    listed, one, unknown, version = run(main())
    assert one.status_code == 200 and one.json() == listed.json()["data"][0] and one.json()["id"] == MODEL
    assert assert_error(unknown, 404, "model")["message"] == "The model `x/y` does not exist."
    assert version.status_code == 200 and version.json() == {"version": importlib.metadata.version("kvserve")}


def test_unknown_model_is_404(client, http, run):
    error = assert_error(run(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"})), 404, "model")
    assert error["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        run(client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}]))


def test_api_key_guards_everything_but_health_and_metrics(app, run):
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as anonymous:
            body = {"prompt": "x", "max_tokens": 1}
            responses = [await anonymous.post("/v1/completions", json=body),
                         await anonymous.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"}),
                         await anonymous.get("/v1/models"), await anonymous.post("/tokenize", json={"prompt": "x"})]
            responses.append(await anonymous.get("/v1/models/tiny"))
            return responses, await anonymous.get("/health"), await anonymous.get("/metrics")

    refused, health, metrics = run(main())
    for response in refused:
        assert assert_error(response, 401)["code"] == "invalid_api_key"
    assert health.status_code == 200
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert parse_metrics(metrics.text)["kvserve:num_requests_running"][0] == "gauge"


def test_full_queue_is_503_and_the_engine_stays_clean(llm, http, run):
    llm.max_waiting_requests = 0  # every request finds the queue full
    try:
        plain = run(http.post("/v1/completions", json={"prompt": "x"}))
        streamed = run(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                               "stream": True}))
    finally:
        llm.max_waiting_requests = None
    assert assert_error(plain, 503)["code"] == "engine_overloaded"
    assert_error(streamed, 503)
    run(until_clean(llm))


def test_a_bad_request_leaves_concurrent_good_ones_intact(client, offline, prompts, llm, run):
    expected = [reference(offline, p, temperature=0.0, max_tokens=10, ignore_eos=True).text for p in prompts[:4]]

    async def main():
        good = [client.completions.create(model=MODEL, prompt=p, max_tokens=10, **GREEDY) for p in prompts[:4]]
        bad = client.completions.create(model=MODEL, prompt=[1, 2, 99999], max_tokens=10)
        return await asyncio.gather(*good[:2], bad, *good[2:], return_exceptions=True)

    results = run(main())
    assert isinstance(results[2], openai.BadRequestError)
    assert [r.choices[0].text for r in results[:2] + results[3:]] == expected
    run(until_clean(llm))
