"""Failures inside the engine behind the OpenAI-compatible HTTP API: 500 with the OpenAI error body, or an
error event once a stream has started; errors from a remote call reach the client as their cause in one clean
line; an OpenAIError crosses processes whole."""

from __future__ import annotations

import json

import httpx
import pytest

from api.errors import ENGINE_DEAD_MESSAGE, INTERNAL_MESSAGE, OVERLOADED_MESSAGE, REQUEST_FAILED_MESSAGE
from api.http_app import build_openai_app
from api.openai_serving import OpenAIServing
from engine import CompletionOutput, EngineDeadError, EngineOverloadedError, RequestFailedError, RequestOutput
from engine.tokenizer import Tokenizer
from tests.serve.openai_harness import MODEL, assert_error, model_dir, run  # noqa: F401 - fixtures


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


def test_openai_errors_cross_processes_whole():
    """Pickled (as a Serve handle's caller receives it), an OpenAIError keeps its status and body."""
    import pickle

    from api.errors import OpenAIError

    error = OpenAIError(404, "The model `x` does not exist.", "NotFoundError", "model", "model_not_found")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is OpenAIError and copy.status == 404 and copy.body() == error.body()
    assert str(copy) == "The model `x` does not exist."
