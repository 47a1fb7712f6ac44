"""Ranks that raise on every step (alive, answering, but broken: a sticky device fault) are rebuilt
after ``max_consecutive_failed_steps`` failed steps with different requests, within the restart
budget, then the engine is dead (and the scheduler actor's ``ready()`` raises, so the replica is
replaced). A poisonous request, failing alone while other steps run between, rebuilds nothing."""

from __future__ import annotations

import pytest

from engine import AsyncLLM
from engine.core import EngineDeadError
from engine.executor import StepFailedError
from tests.engine.test_engine_failures import (
    PARAMS,
    PROMPTS,
    FakeExecutor,
    make_core,
    reference_tokens,
    run,
)


class BrokenExecutor(FakeExecutor):
    """Raises inside the ranks on every step while ``broken``; a rebuild mends it unless ``sticky``."""

    def __init__(self, sticky: bool) -> None:
        super().__init__()
        self.broken, self.sticky = True, sticky

    def execute_model(self, so):
        self.calls += 1
        if self.broken:
            raise StepFailedError("RuntimeError", "CUDA error: an illegal memory access was encountered")
        return self.runner.execute_model(so)

    def restart(self) -> None:
        super().restart()
        self.broken = self.sticky


def test_ranks_failing_every_step_are_rebuilt_and_the_requests_complete(model_dirs):
    expected = reference_tokens(model_dirs, PROMPTS)
    executor = BrokenExecutor(sticky=False)
    core = make_core(model_dirs, executor, max_consecutive_failed_steps=3)
    for i, p in enumerate(PROMPTS):
        core.add_request(f"r{i}", p, PARAMS)
    finals = run(core)
    # step 1 (all three) fails, then each alone: r0 fails (failed), r1 fails (failed), r2 fails: the
    # third step of one request in a row -> rebuild; r2 is recomputed on the new ranks, exactly
    assert executor.restarts == 1 and executor.calls == 4 + 6
    for request_id in ("r0", "r1"):
        assert finals[request_id].error == "the engine failed while running this request (RuntimeError)"
    assert finals["r2"].error is None and finals["r2"].outputs[0].token_ids == expected["r2"]
    stats = core.stats()
    assert stats["num_worker_restarts"] == 1 and stats["num_failed_requests"] == 2
    assert stats["num_failed_steps"] == 4 and stats["num_blocks_in_use"] == 0 and core.dead is None


def test_ranks_still_broken_after_every_rebuild_end_in_engine_dead(model_dirs):
    executor = BrokenExecutor(sticky=True)
    core = make_core(model_dirs, executor, max_worker_restarts=2, max_consecutive_failed_steps=2)
    engine = AsyncLLM(core.config, core=core)
    for i in range(8):
        core.add_request(f"r{i}", PROMPTS[i % 3], PARAMS)
    with pytest.raises(EngineDeadError, match="after 2 restarts"):
        for _ in range(50):
            core.step()
    assert executor.restarts == 2 and core.dead is not None
    with pytest.raises(EngineDeadError):
        core.step()
    # the scheduler actor's readiness check (LLMServer.check_health) now fails
    from cluster.scheduler_actor import SchedulerActor

    actor = SchedulerActor.__new__(SchedulerActor)
    actor.engine = engine
    with pytest.raises(EngineDeadError, match="gives up"):
        actor.ready()


def test_poisonous_requests_with_good_steps_between_rebuild_nothing(model_dirs):
    """Three poisonous requests, each arriving while good requests run: each fails alone, the good
    ones produce exactly their tokens, and the ranks are never rebuilt (a good step always ran
    between two failures)."""
    expected = reference_tokens(model_dirs, PROMPTS)
    executor = FakeExecutor(raise_for="bad")
    core = make_core(model_dirs, executor, max_consecutive_failed_steps=2)
    for i, p in enumerate(PROMPTS):
        core.add_request(f"r{i}", p, PARAMS)
    finals = {}
    for n in range(3):
        core.add_request(f"bad{n}", PROMPTS[0], PARAMS)
        for _ in range(3):
            for out in core.step():
                if out.finished:
                    finals[out.request_id] = out
    finals.update(run(core))
    assert executor.restarts == 0 and core.stats()["num_worker_restarts"] == 0
    assert {k: v.outputs[0].token_ids for k, v in finals.items() if k.startswith("r")} == expected
    assert all(finals[f"bad{n}"].error is not None for n in range(3))
    assert core.stats()["num_failed_requests"] == 3


def test_the_count_is_an_engine_setting_and_an_app_argument(model_dirs):
    from cluster.app_args import ENGINE_KWARGS, AppArgs
    from engine.llm import engine_config

    assert "max_consecutive_failed_steps" in ENGINE_KWARGS
    assert AppArgs(engine_kwargs={"max_consecutive_failed_steps": 5}).max_consecutive_failed_steps == 5
    assert engine_config(model_dirs["llama"]).max_consecutive_failed_steps == 3
    with pytest.raises(ValueError, match="max_consecutive_failed_steps must be an integer >= 2, got 1"):
        engine_config(model_dirs["llama"], max_consecutive_failed_steps=1)
