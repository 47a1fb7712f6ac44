"""What clients read when an engine fails is one fixed sentence per kind of failure, never the
exception's own text: an engine whose step failed on a lost actor (``EngineDeadError`` holding Ray's
"actor died" message: actor id, pid, address) fails its requests in flight with the engine_dead
sentence (HTTP 500, gRPC UNAVAILABLE), and its replica's later refusals (503 engine_unavailable) say
that it gave up, not why in Ray's words. The details go to the log.

Over the Ingress's engine client on a real engine in this process (tests/serve/ingress_fakes.py)."""

from __future__ import annotations

import asyncio
import logging

import grpc
import httpx
import pytest

import serve_app
from api import grpc_serving
from api import kvserve_pb2 as pb
from api.errors import ENGINE_DEAD_MESSAGE
from api.http_app import build_openai_app
from api.openai_serving import OpenAIServing
from engine import EngineDeadError
from engine.tokenizer import Tokenizer
from tests.serve.ingress_fakes import AlwaysUp, FakeLLMServerHandle, replica, shutdown
from tests.serve.openai_harness import model_dir, prompts, run  # noqa: F401 - fixtures

ACTOR_ID = "5f2a9c0e1d3b4a6c7e8f90ab01000000"
RAY_TEXT = (f"engine step failed: ActorDiedError('The actor died unexpectedly before finishing this task. "
            f"class_name: WorkerActor actor_id: {ACTOR_ID} pid: 4242 namespace: kvserve ip: 10.1.2.3')")
LEAKS = ("ActorDiedError", ACTOR_ID, "4242", "10.1.2.3", "pid", "actor_id", "WorkerActor", "Traceback")


class FakeServeContext:
    code = details = None

    def invocation_metadata(self):
        return []

    def set_code(self, code) -> None:
        self.code = code

    def set_details(self, details) -> None:
        self.details = details


def assert_clean(text: str) -> None:
    assert not [leak for leak in LEAKS if leak in text], text


def test_an_engine_dead_on_a_lost_actor_fails_requests_with_fixed_sentences(model_dir, prompts, run, monkeypatch,
                                                                           caplog):
    [server] = servers = [replica(model_dir, "engine:app:r0", num_kv_blocks=300)]
    monkeypatch.setattr(serve_app.ray, "get_actor", lambda name, namespace=None: server.engine)
    client = serve_app.ServeEngineClient(FakeLLMServerHandle(servers), AlwaysUp())
    tokenizer = Tokenizer(model_dir)
    serving = OpenAIServing(client, tokenizer, "m", 2048)
    engine = server.engine.obj.engine  # the scheduler actor's AsyncLLM
    long = {"prompt": prompts[0], "max_tokens": 1500, "ignore_eos": True}

    async def main():
        transport = httpx.ASGITransport(app=build_openai_app(lambda: serving))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            in_flight = asyncio.ensure_future(http.post("/v1/completions", json=long))
            context = FakeServeContext()
            rpc = asyncio.ensure_future(grpc_serving.generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompts[1]), params=pb.SamplingParameters(max_tokens=1500, ignore_eos=True)),
                client, tokenizer, context))
            while engine.core.stats()["num_requests_running"] < 2:
                await asyncio.sleep(0.001)
            error = EngineDeadError(RAY_TEXT)
            engine.core._dead = error  # as the engine leaves it when it gives up on its workers
            engine._fail_all(error)
            with pytest.raises(EngineDeadError):
                await rpc
            failed = await in_flight
            later = [await http.post("/v1/completions", json=long) for _ in range(2)]
            return failed, context, later

    try:
        with caplog.at_level(logging.INFO):
            failed, context, later = run(main())
    finally:
        run(shutdown(servers))
    assert failed.status_code == 500
    assert failed.json()["error"] == {"message": ENGINE_DEAD_MESSAGE, "type": "server_error", "param": None,
                                      "code": "engine_dead"}
    assert (context.code, context.details) == (grpc.StatusCode.UNAVAILABLE, ENGINE_DEAD_MESSAGE)
    # the replica saw that its engine gave up: every later request is refused, in a sentence of its own
    assert [(r.status_code, r.json()["error"]["code"], r.json()["error"]["message"]) for r in later] == [
        (503, "engine_unavailable", "the engine stopped; a new replica is starting"),  # the one that found out
        (503, "engine_unavailable", "the engine stopped (the engine gave up on its workers); a new replica is starting"),
    ]
    for response in [failed, *later]:
        assert_clean(response.text)
    assert ACTOR_ID in caplog.text  # the details are in the log
