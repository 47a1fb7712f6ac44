"""A plan that raises once (a transient fault) is planned again whole: it costs one step, not one
step per request it had reached."""

from __future__ import annotations

from tests.engine.test_engine_failures import PARAMS
from tests.engine.test_step_rollback import make_core

PROMPTS = [[5 + i, 6, 7, 8 + i] for i in range(12)]


def drive(core, fault_at_step: int | None = None) -> tuple[dict, int]:
    """Step to the end; on step ``fault_at_step`` (1-based) the third allocation raises once."""
    kv = core.scheduler.kv
    real = kv.allocate_slots
    calls = [0]

    def allocate(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise MemoryError("no memory")
        return real(*args, **kwargs)

    finals, steps = {}, 0
    while core.has_unfinished_requests() and steps < 400:
        steps += 1
        calls[0] = 0
        kv.allocate_slots = allocate if steps == fault_at_step else real
        for out in core.step():
            if out.finished:
                finals[out.request_id] = out
    return {k: v.outputs[0].token_ids for k, v in finals.items()}, steps


def test_a_one_off_plan_fault_costs_one_step_and_the_tokens_are_exact(model_dirs):
    def fresh():
        core = make_core(model_dirs, num_kv_blocks=64)
        for i, p in enumerate(PROMPTS):
            core.add_request(f"r{i}", p, PARAMS)
        return core

    expected, steps = drive(fresh())
    assert len(expected) == len(PROMPTS)
    core = fresh()
    tokens, faulted_steps = drive(core, fault_at_step=1)
    assert tokens == expected
    assert faulted_steps == steps + 1
    assert core.stats()["num_failed_steps"] == 1 and core.stats()["num_failed_requests"] == 0
    assert core.stats()["num_blocks_in_use"] == 0
