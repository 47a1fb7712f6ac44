"""Nothing per request outlives the request: after many requests that finish, are aborted (before
they reach the engine, while they run), fail alone or are refused, every structure keyed by request
in the engine, the async front and the scheduler actor is empty (a soak's memory stays flat)."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import pytest

from engine import AsyncLLM, SamplingParams
from engine.sampling_params import StructuredOutputsParams
from tests.engine.test_engine_failures import PROMPTS, FakeExecutor, make_core


def assert_nothing_per_request_is_left(actor) -> None:
    engine = actor.engine
    core = engine.core
    sched, kv, outputs = core.scheduler, core.scheduler.kv, core.outputs
    assert (sched.requests, list(sched.waiting), sched.running) == ({}, [], [])
    assert (kv.req_to_blocks, kv._num_cached_blocks, kv.block_pool.num_used_blocks) == ({}, {}, 0)
    assert (sched.grammar_failures, sched.update_failures, sched.failed_plan_requests, sched._step_started) == \
        ([], [], [], [])
    assert (outputs.requests, outputs._by_sample_id, outputs._failed) == ({}, {}, {})
    assert not [s for s in core._suspects if s in sched.requests]
    assert (engine._sinks, engine._commands) == ({}, []) and not engine._compiling
    assert actor._finished == {}
    assert all(not sub.request_ids for sub in actor._subscribers.values())


def test_many_requests_of_every_ending_leave_nothing_behind(model_dirs):
    from cluster.scheduler_actor import SchedulerActor

    executor = FakeExecutor(raise_for="bad")  # any request named bad* makes the step raise inside the ranks
    core = make_core(model_dirs, executor)
    actor = SchedulerActor.__new__(SchedulerActor)  # the actor's request bookkeeping, without Ray
    actor.engine = AsyncLLM(core.config, core=core)
    actor._subscribers, actor._finished = {}, {}
    compiles: list[Future] = []  # compiles that end only after their requests were aborted
    core.structured_outputs.compile_async = lambda spec: compiles.append(Future()) or compiles[-1]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ended: dict[str, str] = {}

    async def one(i: int) -> None:
        kind = ["finish", "n2", "abort_now", "abort_later", "bad", "refused", "abort_compiling"][i % 7]
        request_id = f"bad{i}" if kind == "bad" else f"r{i}"
        p = SamplingParams(temperature=0.0, max_tokens=4, n=2, ignore_eos=True) if kind == "n2" else params
        if kind == "abort_compiling":  # aborted while its grammar compiles: it never reaches the engine
            p = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+"))
        if kind == "refused":
            with pytest.raises(ValueError):
                await actor.add_request(request_id, [10**9], p, None, "ingress-a")
            ended[request_id] = "refused"
            return
        await actor.add_request(request_id, PROMPTS[i % 3], p, None, f"ingress-{'ab'[i % 2]}")
        if kind in ("abort_now", "abort_compiling"):
            actor.abort(request_id)
        elif kind == "abort_later":
            await asyncio.sleep(0.005)
            actor.abort(request_id)
        await asyncio.wait_for(actor.wait_finished(request_id), 10)
        ended[request_id] = kind

    async def main() -> None:
        for wave in range(5):
            await asyncio.gather(*(one(wave * 28 + i) for i in range(28)))
        for future in compiles:
            future.set_result(object())
        for _ in range(50):  # the step loop settles (its last outputs delivered)
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert len(ended) == 140
    assert core.stats()["num_failed_requests"] == 20
    assert_nothing_per_request_is_left(actor)
    # the subscribers got the end of each request that reached the engine (one aborted while it
    # compiled may get an empty final output, or nothing)
    pushed = {rid for sub in actor._subscribers.values() for rid, item in sub.pending
              if isinstance(item, BaseException) or item.finished}
    assert {r for r, kind in ended.items() if kind not in ("refused", "abort_compiling")} <= pushed
    assert pushed <= {r for r, kind in ended.items() if kind != "refused"}
    actor.engine.shutdown()
