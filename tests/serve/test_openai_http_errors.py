"""Errors and failures of the OpenAI-compatible HTTP API: every one has the OpenAI error body and its
status (400 bad input, 401 key, 404 model, 503 full queue, 500 engine failure, or an error event once
a stream has started), a bad request leaves its neighbours intact, and a client that leaves has its
engine requests aborted. Disconnects need real sockets (the ASGI transport buffers whole responses):
those tests run the app under uvicorn on an ephemeral port."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
import uvicorn

from api.errors import ENGINE_DEAD_MESSAGE, INTERNAL_MESSAGE, OVERLOADED_MESSAGE, REQUEST_FAILED_MESSAGE
from api.http_app import build_openai_app
from api.openai_serving import OpenAIServing
from engine import CompletionOutput, EngineDeadError, EngineOverloadedError, RequestFailedError, RequestOutput
from engine.tokenizer import Tokenizer
from tests.serve.openai_harness import (API_KEY, GREEDY, MODEL, REPLICA, app, assert_error,  # noqa: F401
                                        client, http, llm, model_dir, offline, parse_metrics, prompts, reference,
                                        run, until_clean)


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


# --- failures inside the engine ------------------------------------------------------------------


class FailingEngine:
    """An EngineClient whose requests fail after one delta."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.aborted: list[str] = []

    def generate(self, request_id, prompt_token_ids, params, cache_salt):
        async def stream():
            yield RequestOutput(request_id, None, prompt_token_ids, [CompletionOutput(0, "Hi", [5])], False)
            raise self.error
        return stream()

    async def abort(self, request_id) -> None:
        self.aborted.append(request_id)


@pytest.mark.parametrize("error, code", [(EngineDeadError("the workers are gone"), "engine_dead"),
                                         (RuntimeError("boom"), "internal_error")])
def test_engine_failures_are_500_or_an_error_event_once_streaming(model_dir, run, error, code):
    engine = FailingEngine(error)
    serving = OpenAIServing(engine, Tokenizer(model_dir), MODEL, 2048)

    async def main():
        transport = httpx.ASGITransport(app=build_openai_app(lambda: serving))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as raw:
            body = {"messages": [{"role": "user", "content": "x"}]}
            return (await raw.post("/v1/chat/completions", json=body),
                    await raw.post("/v1/chat/completions", json={**body, "stream": True}))

    plain, streamed = run(main())
    assert assert_error(plain, 500)["code"] == code
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in streamed.text.split("\n\n") if line]
    role, delta, failure, done = events
    assert json.loads(role)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert json.loads(delta)["choices"][0]["delta"] == {"content": "Hi"}
    assert json.loads(failure)["error"]["code"] == code and done == "[DONE]"
    assert engine.aborted == []  # the engine ended those requests itself


def ray_task_error(cause: Exception) -> Exception:
    """What a Serve handle call raises when the remote method raised ``cause``: Ray's RayTaskError,
    an instance of the cause's class whose text is a coloured traceback with task name, pid and IP."""
    from ray.exceptions import RayTaskError

    try:
        raise cause
    except Exception as exc:
        traceback = "".join(__import__("traceback").format_exception(exc))
        error = RayTaskError("ServeReplica:kvserve:LLMServer.generate", traceback, exc, pid=4242, ip="10.1.2.3",
                             actor_id="5f2a9c0e1d3b4a6c7e8f90ab01000000")
    return error.as_instanceof_cause()


class RefusingEngine:
    """An EngineClient whose requests raise ``error`` before any output."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def generate(self, request_id, prompt_token_ids, params, cache_salt):
        async def stream():
            raise self.error
            yield  # an async generator
        return stream()

    async def abort(self, request_id) -> None:
        pass


LEAKS = ("ray::", "ServeReplica", "pid=", "4242", "10.1.2.3", "5f2a9c0e", "Traceback", "File \"", "\x1b[")


@pytest.mark.parametrize("cause, status, code, message", [
    (ValueError("stop_token_ids must be in [0, 4096)"), 400, 400, "stop_token_ids must be in [0, 4096)"),
    (EngineOverloadedError("the queue holds 64 requests"), 503, "engine_overloaded", OVERLOADED_MESSAGE),
    (EngineDeadError("engine step failed: ActorDiedError('actor 5f2a9c0e died, pid=4242, ip=10.1.2.3')"), 500,
     "engine_dead", ENGINE_DEAD_MESSAGE),
    (RequestFailedError("the engine failed while running this request (IndexError)"), 500, "request_failed",
     REQUEST_FAILED_MESSAGE),
    (RuntimeError("CUDA error at 0x7f00 in worker pid 99"), 500, "internal_error", INTERNAL_MESSAGE),
])
def test_errors_from_a_remote_call_reach_the_client_as_their_cause_in_one_clean_line(model_dir, run, cause, status,
                                                                                    code, message):
    wrapped = ray_task_error(cause)
    assert isinstance(wrapped, type(cause)) and "(pid=4242, ip=10.1.2.3)" in str(wrapped) and "\x1b[" in str(wrapped)
    serving = OpenAIServing(RefusingEngine(wrapped), Tokenizer(model_dir), MODEL, 2048)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_openai_app(lambda: serving)),
                                     base_url="http://test") as raw:
            return (await raw.post("/v1/completions", json={"prompt": "x"}),
                    await raw.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                                 "stream": True}))

    for response in run(main()):
        error = assert_error(response, status)
        assert (error["message"], error["code"]) == (message, code)
        assert not [leak for leak in LEAKS if leak in response.text]


def test_an_error_event_mid_stream_carries_the_cause_alone(model_dir, run):
    engine = FailingEngine(ray_task_error(ValueError("a stop string is too long")))
    serving = OpenAIServing(engine, Tokenizer(model_dir), MODEL, 2048)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_openai_app(lambda: serving)),
                                     base_url="http://test") as raw:
            return await raw.post("/v1/completions", json={"prompt": "x", "stream": True})

    streamed = run(main())
    events = [line.removeprefix("data: ") for line in streamed.text.split("\n\n") if line]
    assert json.loads(events[-2])["error"] == {"message": "a stop string is too long", "type": "invalid_request_error",
                                               "param": None, "code": 400}
    assert events[-1] == "[DONE]" and not [leak for leak in LEAKS if leak in streamed.text]


# --- clients that leave ------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def uvicorn_server(app) -> AsyncIterator[str]:
    """The app behind a real socket (the ASGI transport cannot disconnect mid-response)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task


def test_clients_that_leave_abort_their_engine_requests(app, llm, prompts, run, caplog):
    async def main():
        async with uvicorn_server(app) as url, \
                openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0) as client:
            before = llm.stats()["num_generation_tokens"]
            stream = await client.completions.create(model=MODEL, prompt=prompts[1:3], n=2, max_tokens=2000,
                                                     stream=True, **GREEDY)
            chunks = []
            async for chunk in stream:
                chunks.append(chunk)
                if len(chunks) == 5:
                    break
            await stream.close()  # 2 prompts x 2 samples were running: all must stop
            await until_clean(llm)
            streamed_tokens = llm.stats()["num_generation_tokens"] - before
            with pytest.raises(openai.APITimeoutError):  # a non-streaming client that gives up
                await client.completions.create(model=MODEL, prompt=prompts[2], max_tokens=2000, timeout=0.3,
                                                **GREEDY)
            await until_clean(llm)
            return chunks, streamed_tokens, llm.stats()["num_generation_tokens"] - before - streamed_tokens

    chunks, streamed_tokens, waited_tokens = run(main())
    assert len(chunks) == 5
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "the server logged errors"
    assert streamed_tokens < 4 * 2000 // 2 and waited_tokens < 2000 // 2  # stopped, not run to the end


def test_openai_errors_cross_processes_whole():
    """Pickled (as a Serve handle's caller receives it), an OpenAIError keeps its status and body."""
    import pickle

    from api.errors import OpenAIError

    error = OpenAIError(404, "The model `x` does not exist.", "NotFoundError", "model", "model_not_found")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is OpenAIError and copy.status == 404 and copy.body() == error.body()
    assert str(copy) == "The model `x` does not exist."
