"""The gRPC service logic alone (api/grpc_serving.py), on a fake engine client: a consumer leaving aborts, errors
on a Serve context set the status code and re-raise, the API key on a Serve context, fixed sentences for failures."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from api import grpc_serving
from api import kvserve_pb2 as pb
from api.errors import ENGINE_DEAD_MESSAGE, INTERNAL_MESSAGE, OVERLOADED_MESSAGE, REQUEST_FAILED_MESSAGE
from engine import EngineDeadError, EngineOverloadedError, RequestFailedError
from engine.messages import CompletionOutput, RequestOutput
from engine.tokenizer import Tokenizer
from tests.serve.grpc_harness import (  # noqa: F401 (model_dir, offline, server: fixtures)
    model_dir,
    request,
)

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
