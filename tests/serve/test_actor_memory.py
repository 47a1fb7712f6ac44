"""The scheduler actor keeps nothing per request once its requests ended: under the soak's pattern
(requests read to the end, and streams the client cuts after their first chunk, which the Ingress and
the LLMServer both abort), the actor's ``_finished``, its subscribers' request ids and pending
outputs, the engine's sinks, and the Ingress's queues are all empty once the load stops.

(The RSS growth the soak showed in the scheduler actor, ~1.6 KB per request, is the KV pool making
its block objects as requests first use fresh block ids, up to ``num_kv_blocks``: see
benchmarks/actor_memory.py. This pins the per-request bookkeeping of the actor layer.)

The Ingress's engine client runs over a real LLMServer and SchedulerActor in this process
(tests/serve/ingress_fakes.py)."""

from __future__ import annotations

import asyncio

import pytest

import serve_app
from engine import SamplingParams
from tests.serve.ingress_fakes import AlwaysUp, FakeLLMServerHandle, replica, shutdown
from tests.serve.openai_harness import model_dir, prompts, run  # noqa: F401 - fixtures

REQUESTS = 60
CONCURRENCY = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def server(model_dir, run):  # noqa: F811 - fixtures
    servers = [replica(model_dir, "engine:app:r0", num_kv_blocks=300)]
    yield servers[0]
    run(shutdown(servers))


def held(client, server) -> dict:
    """What the Ingress, the LLMServer, the actor and its engine still hold per request."""
    actor = server.engine.obj
    subscribers = actor._subscribers.values()
    return {k: v for k, v in {
        "actor._finished": len(actor._finished),
        "subscriber request ids": sum(len(s.request_ids) for s in subscribers),
        "subscriber pending": sum(len(s.pending) for s in subscribers),
        "engine sinks": len(actor.engine._sinks),
        "engine compiling": len(actor.engine._compiling),
        "llm_server aborting": len(server._aborting),
        "ingress queues": len(client._queues),
        "ingress engine ids": len(client._engine_of),
        "ingress in flight": client.in_flight,
    }.items() if v}


def test_the_actor_holds_nothing_per_request_after_a_mixed_load(server, prompts, run, monkeypatch):  # noqa: F811
    monkeypatch.setattr(serve_app.ray, "get_actor", lambda name, namespace=None: server.engine)
    client = serve_app.ServeEngineClient(FakeLLMServerHandle([server]), AlwaysUp())
    counter = iter(range(REQUESTS))
    cut = read = 0

    async def one(n: int) -> None:
        nonlocal cut, read
        prompt = prompts[n % len(prompts)] + [3 + n % 50]
        async with asyncio.timeout(20):
            stream = client.generate(f"label-{n}", prompt, PARAMS)
            async for output in stream:
                if n % 5 == 4:  # the client leaves after its first chunk
                    cut += 1
                    break
                if output.finished:
                    read += 1
            await stream.aclose()

    async def worker() -> None:
        for n in counter:
            await one(n)

    async def main() -> dict:
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        deadline = asyncio.get_running_loop().time() + 10
        while (left := held(client, server)) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        for task in client._subscriptions.values():
            task.cancel()
        return left

    left = run(main())
    assert (read, cut) == (REQUESTS - REQUESTS // 5, REQUESTS // 5)
    assert left == {}
    stats = server.engine.obj.stats()
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == stats["num_blocks_in_use"] == 0
