"""The compile path's waiting (engine/async_engine.py, engine/structured_output.py, engine/llm.py): the
compile timeout counts from when a compile starts, not the time queued behind others; a compile that
never starts within it is overload (503), not the constraint's fault (400); requests joining a pending
compile are counted and capped; the offline path compiles any number of distinct constraints in
windows of the pending bound; a cached grammar keeps nothing of the requests that waited for it."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest

from engine import LLM, AsyncLLM, EngineOverloadedError, RequestFailedError, SamplingParams
from engine.sampling_params import StructuredOutputsParams as SO
from tests.engine.test_engine_failures import FakeExecutor, make_core
from tests.engine.test_structured_bounds import GRAMMAR_REJECTED, Gate, choice, finish

TIMED_OUT = ("the structured output constraint did not compile within "
             "structured_output_compile_timeout_s=0.3 s; make it smaller or shallower.")


def slow_compiles(manager, delays: dict[str, float | threading.Event]) -> None:
    """Each compile whose spec mentions a key of ``delays`` first sleeps that many seconds, or waits (30 s
    at most) until that event is set."""
    backend = manager.backend
    real = backend.compile

    def compile(kind, spec):
        delay = next((d for k, d in delays.items() if k in str(spec)), 0.0)
        if isinstance(delay, threading.Event):
            delay.wait(30)
        else:
            time.sleep(delay)
        return real(kind, spec)

    backend.compile = compile


def test_the_compile_timeout_counts_from_the_compile_start_not_the_queue(model_dirs):
    # one thread: c1 waits 0.2 s behind c0, then compiles 0.2 s; 0.4 s after it came, within 0.3 s of its start
    core = make_core(model_dirs, FakeExecutor(), structured_output_compile_timeout_s=0.3,
                     structured_output_compile_threads=1)
    engine = AsyncLLM(core.config, core=core)
    slow_compiles(core.structured_outputs, {"yes0": 0.2, "yes1": 0.2})

    async def main():
        start = asyncio.get_running_loop().time()
        results = await asyncio.gather(finish(engine, "c0", choice(0)), finish(engine, "c1", choice(1)),
                                       return_exceptions=True)
        assert asyncio.get_running_loop().time() - start >= 0.4
        assert [str(r) for r in results] == [GRAMMAR_REJECTED] * 2  # both compiled and were admitted
        assert all(isinstance(r, RequestFailedError) for r in results)

    asyncio.run(main())
    assert not engine._sinks and not engine._compiling
    engine.shutdown()


def test_a_compile_that_never_starts_within_the_timeout_is_overload_and_a_slow_one_is_the_clients(model_dirs):
    core = make_core(model_dirs, FakeExecutor(), structured_output_compile_timeout_s=0.3,
                     structured_output_compile_threads=1)
    engine = AsyncLLM(core.config, core=core)
    gate = Gate(core.structured_outputs)

    async def main():
        slow, queued = await asyncio.gather(finish(engine, "slow", choice(0)), finish(engine, "queued", choice(1)),
                                            return_exceptions=True)
        assert type(slow) is ValueError and str(slow) == TIMED_OUT  # its compile ran past the timeout: 400
        assert type(queued) is EngineOverloadedError and str(queued) == (  # never started: 503
            "the structured output constraint waited more than structured_output_compile_timeout_s=0.3 s "
            "for one of the structured_output_compile_threads=1 compile threads; retry later.")
        assert not engine._sinks and not engine._compiling

    asyncio.run(main())
    gate.open.set()
    engine.shutdown()


def test_requests_joining_a_pending_compile_are_counted_and_capped(model_dirs):
    core = make_core(model_dirs, FakeExecutor(), structured_output_compile_threads=1)
    engine = AsyncLLM(core.config, core=core, max_waiting_requests=2)
    gate = Gate(core.structured_outputs)
    got: dict[str, list] = {"c0": [], "c0-again": []}

    async def main():
        engine.submit("c0", [5, 6], choice(0), got["c0"].append)
        engine.submit("c0-again", [5, 6], choice(0), got["c0-again"].append)  # joins c0's compile
        assert core.structured_outputs.num_pending == 1
        with pytest.raises(EngineOverloadedError) as info:  # a third on the same compile: past the cap
            engine.submit("c0-third", [5, 6], choice(0), lambda item: None)
        assert str(info.value) == ("2 requests are already waiting for their structured output grammar "
                                   "(max_waiting_requests=2); retry later")
        assert await finish(engine, "plain", SamplingParams(max_tokens=2, ignore_eos=True))  # not counted
        gate.open.set()
        for _ in range(500):
            if all(items and isinstance(items[-1], BaseException) for items in got.values()):
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert [str(items[-1]) for items in got.values()] == [GRAMMAR_REJECTED] * 2
    assert not engine._sinks and not engine._compiling
    engine.shutdown()


def test_a_cached_grammar_keeps_nothing_of_the_requests_that_waited_for_it(model_dirs):
    core = make_core(model_dirs, FakeExecutor())
    engine = AsyncLLM(core.config, core=core)
    gate = Gate(core.structured_outputs)
    params = SamplingParams(max_tokens=3, seed=424242, structured_outputs=SO(choice=("yes", "no")))

    async def main():
        engine.submit("r", [5, 6], params, lambda item: None)
        while not gate.started:  # its compile started (it runs on once nobody waits)
            await asyncio.sleep(0.01)
        engine.abort("r")
        gate.open.set()
        while core.structured_outputs.num_pending:
            await asyncio.sleep(0.01)

    asyncio.run(main())
    (future,) = core.structured_outputs._cache.values()  # the grammar stays cached, its callbacks too
    assert future.done() and future._done_callbacks
    gc.collect()
    kept = [o for o in gc.get_objects() if isinstance(o, SamplingParams) and o.seed == 424242 and o is not params]
    assert kept == []  # the request's copy of its params (and its prompt with it) is gone
    engine.shutdown()


def test_offline_generate_compiles_more_distinct_constraints_than_the_pending_bound(model_dirs):
    with LLM(model=model_dirs["llama"], num_kv_blocks=256, block_size=4, max_model_len=128,
             structured_output_max_pending_compiles=64) as llm:
        choices = [(f"yes{i}", f"no{i}") for i in range(70)]
        params = [SamplingParams(max_tokens=8, structured_outputs=SO(choice=c)) for c in choices]
        outputs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 70, params)
        assert len(outputs) == 70 and all(o.error is None for o in outputs)
        texts = [o.outputs[0].text for o in outputs]
        assert all(any(c.startswith(t) for c in cs) for t, cs in zip(texts, choices))
        assert llm.core.structured_outputs.num_pending == 0 and llm.core.structured_outputs.num_compiled == 70


def test_offline_compiles_wait_for_a_place_left_by_a_compile_that_outlived_its_call(model_dirs):
    core = make_core(model_dirs, FakeExecutor(), structured_output_compile_timeout_s=0.3,
                     structured_output_max_pending_compiles=2)
    llm = object.__new__(LLM)
    llm.core = core
    # the slow compile held until the others are counted (a fixed sleep of 0.6 s ended before them once
    # on a loaded CI machine: 4 compiled, none pending)
    release = threading.Event()
    slow_compiles(core.structured_outputs, {"slow": release})
    try:
        with pytest.raises(ValueError, match="did not compile within structured_output_compile_timeout_s=0.3 s"):
            llm._compile_all([SamplingParams(structured_outputs=SO(choice=("slow", "no")))])
        assert core.structured_outputs.num_pending == 1  # it runs on, holding one of the 2 places
        params = [SamplingParams(structured_outputs=SO(choice=(f"yes{i}", f"no{i}"))) for i in range(3)]
        grammars = llm._compile_all([SamplingParams()] + params)
        assert grammars[0] is None and all(g is not None for g in grammars[1:])
        # they went on beside the one still running (3 compiled, it still pending), never past the bound
        assert (core.structured_outputs.num_compiled, core.structured_outputs.num_pending) == (3, 1)
    finally:
        release.set()


def slow_backend_set_up(monkeypatch, seconds: float) -> None:
    """The structured output backend takes ``seconds`` to build (its one-time set-up at the first compile)."""
    import engine.structured_output as structured_output

    real_load = structured_output._load

    def load(target: str):
        backend = real_load(target)

        class SlowToBuild(backend):
            def __init__(self, *args, **kwargs) -> None:
                time.sleep(seconds)
                super().__init__(*args, **kwargs)

        return SlowToBuild

    monkeypatch.setattr(structured_output, "_load", load)


def test_the_backends_one_time_set_up_is_no_compiles_time(model_dirs, monkeypatch):
    """The backend is built at the first compile (the tokenizer's vocabulary read once: ~2 s on the 2-core
    VM, over 10 s beside a three-worker test run). That is neither the constraint's compile time (before,
    a one-field tool schema failed with "did not compile within 10 s; make it smaller") nor a compile
    queue (503): offline and through the async engine, the first constrained request waits for it and
    runs."""
    slow_backend_set_up(monkeypatch, 0.6)
    offline = make_core(model_dirs, FakeExecutor(), structured_output_compile_timeout_s=0.3).structured_outputs
    assert offline.compile(choice(0).structured_outputs) is not None and offline.backend_ready
    offline.shutdown()
    core = make_core(model_dirs, FakeExecutor(), structured_output_compile_timeout_s=0.3)
    engine = AsyncLLM(core.config, core=core)

    async def main():
        start = asyncio.get_running_loop().time()
        (result,) = await asyncio.gather(finish(engine, "c0", choice(0)), return_exceptions=True)
        assert asyncio.get_running_loop().time() - start >= 0.6
        assert str(result) == GRAMMAR_REJECTED and isinstance(result, RequestFailedError)  # compiled, admitted

    asyncio.run(main())
    assert not engine._sinks and not engine._compiling
    engine.shutdown()
