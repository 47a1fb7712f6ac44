"""Request ids at the Ingress are the server's own: a client's id (gRPC ``request_id``) is only the
label its responses carry, so requests that reuse one (or reuse an id the server gave another
request) neither fail, nor share outputs, nor remove each other's entries. And a client that leaves
while its request is being admitted has it aborted once the engine knows it (its KV freed, not run
to max_tokens).

The Ingress's engine client runs over real engines in this process (tests/serve/ingress_fakes.py:
the real LLMServer request path and SchedulerActor, Ray's and Serve's handles stood in for)."""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace

import httpx
import pytest

import serve_app
from api import grpc_serving
from api import kvserve_pb2 as pb
from api.engine_client import AsyncLLMClient
from api.http_app import build_openai_app
from api.openai_serving import OpenAIServing
from engine import AsyncLLM, SamplingParams, engine_config
from engine.tokenizer import Tokenizer
from tests.serve.ingress_fakes import AlwaysUp, FakeLLMServerHandle, replica, shutdown
from tests.serve.openai_harness import model_dir, offline, prompts, run  # noqa: F401 - fixtures

TIMEOUT_S = 20


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def expected_ids(offline, prompt: list[int], max_tokens: int) -> list[int]:  # noqa: F811 - fixture
    return offline.generate({"prompt_token_ids": prompt}, greedy(max_tokens))[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def replicas(model_dir, run):  # noqa: F811 - fixtures
    """Two LLMServer replicas, each with its engine."""
    servers = [replica(model_dir, f"engine:app:r{i}", num_kv_blocks=300) for i in range(2)]
    yield servers
    run(shutdown(servers))


@pytest.fixture()
def ingress_client(replicas, monkeypatch):
    """The Ingress's engine client over both replicas (calls alternate between them)."""
    actors = {server.engine_name: server.engine for server in replicas}
    monkeypatch.setattr(serve_app.ray, "get_actor", lambda name, namespace=None: actors[name])
    return serve_app.ServeEngineClient(FakeLLMServerHandle(replicas), AlwaysUp())


async def collect(stream) -> list[int]:
    ids = []
    async for output in stream:
        ids += output.outputs[0].token_ids
    return ids


async def until_clean(server, timeout_s: float = 10.0) -> dict:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        stats = server.engine.obj.stats()
        if stats["num_requests_running"] == stats["num_requests_waiting"] == stats["num_blocks_in_use"] == 0:
            return stats
        assert asyncio.get_running_loop().time() < deadline, f"the engine still holds requests: {stats}"
        await asyncio.sleep(0.01)


def test_a_refused_request_reusing_an_id_leaves_the_request_that_holds_it_running(ingress_client, replicas,
                                                                                 prompts, offline, run):
    """A second request with the first's id that the engine refuses (a token outside the vocabulary)
    removed the first's queue: the first then waited for outputs that went nowhere."""
    ingress_client.handle._next = iter([replicas[0]] * 2)  # both on one replica

    async def main():
        first = ingress_client.generate("dup", prompts[0], greedy(200))
        head = await asyncio.wait_for(first.__anext__(), TIMEOUT_S)
        with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, "):
            await asyncio.wait_for(collect(ingress_client.generate("dup", [10**6], greedy(4))), TIMEOUT_S)
        rest = await asyncio.wait_for(collect(first), TIMEOUT_S)
        return head.outputs[0].token_ids + rest

    assert run(main()) == expected_ids(offline, prompts[0], 200)
    assert ingress_client._queues == {} and ingress_client._engine_of == {}


def test_requests_sharing_an_id_on_one_or_two_replicas_each_get_their_own_tokens(ingress_client, prompts, offline,
                                                                                run):
    """Three requests labelled "dup" at once: two on one replica (its engine refused the second's id),
    one on the other (its outputs went to the other requests' queue)."""
    async def main():
        streams = [ingress_client.generate("dup", prompts[i], greedy(12)) for i in range(3)]
        return await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), TIMEOUT_S)

    assert run(main()) == [expected_ids(offline, prompts[i], 12) for i in range(3)]


def test_a_grpc_id_equal_to_an_http_response_id_in_flight(ingress_client, replicas, model_dir, prompts, offline,
                                                          run, monkeypatch):
    """A gRPC client that reuses the id of an HTTP completion still running (``cmpl-…``, the id its
    response shows): both complete with their own tokens, the gRPC response labelled as asked."""
    from api import openai_serving

    made = uuid.UUID(int=7)
    monkeypatch.setattr(openai_serving, "uuid", SimpleNamespace(uuid4=lambda: made))  # the HTTP id, known ahead
    label = f"cmpl-{made.hex}"
    [server] = [s for s in replicas if s.engine_name.endswith("r0")]
    ingress_client.handle._next = iter([server] * 2)
    tokenizer = Tokenizer(model_dir)
    serving = OpenAIServing(ingress_client, tokenizer, "m", 2048)

    async def main():
        transport = httpx.ASGITransport(app=build_openai_app(lambda: serving))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            body = {"prompt": prompts[1], "max_tokens": 300, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            completion = asyncio.ensure_future(http.post("/v1/completions", json=body, timeout=TIMEOUT_S))
            while server.engine.obj.stats()["num_requests_running"] == 0:  # the completion is running
                await asyncio.sleep(0.001)
            reply = await grpc_serving.generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompts[2]), request_id=label,
                params=pb.SamplingParameters(max_tokens=10, temperature=0.0, ignore_eos=True)),
                ingress_client, tokenizer)
            return reply, (await asyncio.wait_for(completion, TIMEOUT_S)).json()

    reply, completion = run(main())
    assert completion["id"] == reply.request_id == label
    assert list(reply.completions[0].token_ids) == expected_ids(offline, prompts[2], 10)
    assert completion["choices"][0]["token_ids"] == expected_ids(offline, prompts[1], 300)


def test_grpc_requests_reusing_an_id_both_complete_with_their_own_tokens(model_dir, prompts, offline, run):
    """On any engine client (here one in-process engine): the client's id was the engine's, so the
    second request in flight with it was refused ("already in use")."""
    engine = AsyncLLM(engine_config(model_dir, num_kv_blocks=200))
    tokenizer = Tokenizer(model_dir)

    def request(prompt: list[int]) -> pb.GenerateRequest:
        return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), request_id="same",
                                  params=pb.SamplingParameters(max_tokens=16, temperature=0.0, ignore_eos=True))

    async def main():
        try:
            return await asyncio.wait_for(asyncio.gather(*(
                grpc_serving.generate(request(prompts[i]), AsyncLLMClient(engine), tokenizer) for i in (3, 4))),
                TIMEOUT_S)
        finally:
            engine.shutdown()

    replies = run(main())
    assert [r.request_id for r in replies] == ["same", "same"]
    assert [list(r.completions[0].token_ids) for r in replies] == [expected_ids(offline, prompts[i], 16)
                                                                   for i in (3, 4)]


def test_a_client_leaving_during_admission_has_its_request_aborted(model_dir, prompts, run, monkeypatch):
    """The cancel reaches the replica while it awaits the engine's add_request: the request is aborted
    once the engine has it (KV freed, counted aborted), not run to its max_tokens."""
    [server] = servers = [replica(model_dir, "engine:app:slow", delays={"add_request": 0.3}, num_kv_blocks=300)]
    monkeypatch.setattr(serve_app.ray, "get_actor", lambda name, namespace=None: server.engine)
    client = serve_app.ServeEngineClient(FakeLLMServerHandle(servers), AlwaysUp())

    async def main():
        try:
            leaver = asyncio.ensure_future(collect(client.generate("leaver", prompts[0], greedy(1500))))
            await asyncio.sleep(0.1)  # the replica is awaiting the engine's admission
            leaver.cancel()
            with pytest.raises(asyncio.CancelledError):
                await leaver
            assert client.handle.calls[0].cancelled
            await asyncio.sleep(0.5)  # admitted meanwhile
            return await until_clean(server)
        finally:
            await shutdown(servers)

    stats = run(main())
    assert stats["finished_requests"] == {"stop": 0, "length": 0, "abort": 1}
    assert stats["num_generation_tokens"] < 1500
