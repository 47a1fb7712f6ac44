"""AsyncLLM's step loop over a model-free executor: a failing add or abort touches only its own
request, the rest of the batch runs to completion, and the loop never dies."""

from __future__ import annotations

import asyncio

from engine import AsyncLLM
from engine.async_engine import ADD_FAILED, STEP_FAILED
from engine.core import EngineDeadError, RequestFailedError
from tests.engine.test_engine_failures import (
    PARAMS,
    PROMPTS,
    FakeExecutor,
    make_core,
    reference_tokens,
)


def collect(engine: AsyncLLM, request_ids, results: dict) -> None:
    for request_id, prompt in request_ids:
        def sink(item, request_id=request_id):
            results.setdefault(request_id, []).append(item)
        engine.submit(request_id, prompt, PARAMS, sink)


async def wait_all(results: dict, ids, timeout: float = 10.0) -> None:
    def done(items):
        return items and (isinstance(items[-1], BaseException) or items[-1].finished)
    for _ in range(int(timeout / 0.01)):
        if all(done(results.get(i)) for i in ids):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"requests did not end: {[i for i in ids if not done(results.get(i))]}")


def tokens(items) -> list[int]:
    return [t for item in items for t in item.outputs[0].token_ids]


def test_a_failing_add_fails_that_request_alone_and_the_batch_completes(model_dirs):
    expected = reference_tokens(model_dirs, PROMPTS)
    core = make_core(model_dirs, FakeExecutor())
    real_add = core.add_processed_request

    def add(request_id, *args, **kwargs):
        if request_id == "bad":
            real_add(request_id, *args, **kwargs)  # it got into the engine, then something broke
            raise KeyError("internal detail 0x7f")
        return real_add(request_id, *args, **kwargs)

    core.add_processed_request = add
    engine = AsyncLLM(core.config, core=core)
    results: dict = {}

    async def main():
        collect(engine, [("r0", PROMPTS[0]), ("bad", PROMPTS[1]), ("r1", PROMPTS[1]), ("r2", PROMPTS[2])], results)
        await wait_all(results, ["r0", "bad", "r1", "r2"])

    asyncio.run(main())
    assert len(results["bad"]) == 1 and isinstance(results["bad"][0], RequestFailedError)
    assert str(results["bad"][0]) == ADD_FAILED
    assert {k: tokens(results[k]) for k in ("r0", "r1", "r2")} == expected
    # nothing of the failed request is left behind
    assert not core.scheduler.requests and not core.outputs.requests and not engine._sinks
    assert core.stats()["num_blocks_in_use"] == 0
    engine.shutdown()


def test_a_failing_abort_is_logged_and_the_request_still_ends(model_dirs):
    expected = reference_tokens(model_dirs, PROMPTS)
    core = make_core(model_dirs, FakeExecutor())
    real_abort = core.abort_request

    def abort(request_id):
        if request_id == "gone":
            real_abort(request_id)
            raise RuntimeError("abort broke")
        return real_abort(request_id)

    core.abort_request = abort
    engine = AsyncLLM(core.config, core=core)
    results: dict = {}

    async def main():
        collect(engine, [("r0", PROMPTS[0]), ("gone", PROMPTS[0]), ("r1", PROMPTS[1])], results)
        engine.abort("gone")  # in the same batch of commands as the adds
        collect(engine, [("r2", PROMPTS[2])], results)
        await wait_all(results, ["r0", "gone", "r1", "r2"])

    asyncio.run(main())
    assert results["gone"][-1].finished and results["gone"][-1].outputs == []
    assert {k: tokens(results[k]) for k in ("r0", "r1", "r2")} == expected
    assert not core.scheduler.requests and not core.outputs.requests and not engine._sinks
    assert core.stats()["num_blocks_in_use"] == 0
    engine.shutdown()


def test_a_request_aborted_before_it_reached_the_engine_is_not_waited_on(model_dirs):
    """Aborted while its grammar compiles (not yet in the engine): nothing more comes for it, and the
    scheduler actor's bookkeeping (``wait_finished``, which the LLMServer call awaits, and the
    subscriber's request ids) ends at once instead of waiting forever."""
    from concurrent.futures import Future

    from cluster.scheduler_actor import SchedulerActor
    from engine.sampling_params import SamplingParams, StructuredOutputsParams

    core = make_core(model_dirs, FakeExecutor())
    pending: Future = Future()
    core.structured_outputs.compile_async = lambda spec: pending
    actor = SchedulerActor.__new__(SchedulerActor)  # the actor's request bookkeeping, without Ray
    actor.engine = AsyncLLM(core.config, core=core)
    actor._subscribers, actor._finished = {}, {}
    params = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+"))

    async def main():
        await actor.add_request("a", PROMPTS[0], params, None, "ingress")
        actor.abort("a")
        await asyncio.wait_for(actor.wait_finished("a"), 1.0)
        pending.set_result(object())  # compiled after the abort: nothing is queued
        await asyncio.sleep(0.05)

    asyncio.run(main())
    engine = actor.engine
    assert not engine.is_open("a") and not engine._sinks and not engine._commands and not core.scheduler.requests
    assert actor._finished == {} and actor._subscribers["ingress"].request_ids == set()
    engine.shutdown()


def test_a_step_failure_sends_one_clean_sentence(model_dirs):
    core = make_core(model_dirs, FakeExecutor())

    def step():
        raise RuntimeError("<Actor 9f3a pid=4242 at 10.0.0.7>")

    core.step = step
    engine = AsyncLLM(core.config, core=core)
    results: dict = {}

    async def main():
        collect(engine, [("r0", PROMPTS[0])], results)
        await wait_all(results, ["r0"])

    asyncio.run(main())
    [error] = results["r0"]
    assert isinstance(error, EngineDeadError) and str(error) == STEP_FAILED
    engine.shutdown()
