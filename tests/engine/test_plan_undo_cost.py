"""What ``PlanUndo`` keeps does not grow with the waiting queue (the queue logs the plan's changes
instead of being copied), and a plan undone takes back exactly the queue-time samples it added."""

from __future__ import annotations

import pytest

from engine.core import EngineCore
from engine.llm import engine_config
from engine.plan_undo import PlanUndo
from tests.engine.test_engine_failures import PARAMS, FakeExecutor


def make_core(model_dirs, num_requests: int) -> EngineCore:
    config = engine_config(model_dirs["llama"], num_kv_blocks=512, block_size=4, max_model_len=64, max_num_seqs=8)
    core = EngineCore(config, executor=FakeExecutor())
    for i in range(num_requests):
        core.add_request(f"r{i}", [5 + i % 40, 6, 7], PARAMS)
    return core


def test_the_undo_record_does_not_copy_the_waiting_queue(model_dirs):
    core = make_core(model_dirs, 600)
    core.step()
    sched = core.scheduler
    assert len(sched.running) == 8 and len(sched.waiting) == 592
    plan = PlanUndo(sched)
    sizes = {name: len(value) for name, value in vars(plan).items() if hasattr(value, "__len__")}
    assert max(sizes.values()) < 100, sizes
    plan.apply()
    assert [r.request_id for r in sched.waiting] == [f"r{i}#0" for i in range(8, 600)]


def test_an_undone_plan_takes_back_its_queue_time_samples_and_queue_order(model_dirs, monkeypatch):
    core = make_core(model_dirs, 20)
    sched = core.scheduler
    hist = sched.stats.queue_time
    before = (list(hist.counts), hist.total, hist.count, [r.request_id for r in sched.waiting])
    real, calls = sched.kv.allocate_slots, [0]

    def allocate(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 5:  # four requests were first scheduled (their samples observed), then it raises
            raise MemoryError("no memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(sched.kv, "allocate_slots", allocate)
    with pytest.raises(MemoryError):
        sched.schedule()
    assert (list(hist.counts), hist.total, hist.count, [r.request_id for r in sched.waiting]) == before
    assert sched.waiting.log is None and not sched.running
