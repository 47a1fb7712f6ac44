"""A failure while a step is planned (an allocation, the host tier's swap planning, the grammar
bitmask, a Ctrl-C) leaves the scheduler, the pool, the prefix cache and the host tier exactly as
before the step; the engine stays alive and the requests produce exactly the tokens a run without
the fault gives. A failure while a step's outputs are taken ends only the requests it concerns."""

from __future__ import annotations

import pytest

from engine.core import EngineCore
from engine.llm import engine_config
from tests.engine.fakes import FakeRunner, check_ref_counts
from tests.engine.test_engine_failures import PARAMS, FakeExecutor, run

# prompts sharing prefixes (hits), in a pool too small for all of them (preemption, eviction)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 9, 10, 11, 12, 40, 41], [20, 21, 22, 23, 24],
           [5, 6, 7, 8, 30, 31, 32, 33, 34, 35], [20, 21, 22, 23, 50, 51]]


class KVExecutor(FakeExecutor):
    """The fake ranks keeping the 'KV' they write; ``host_blocks``: the size of a host tier."""

    def __init__(self, host_blocks: int = 0) -> None:
        super().__init__()
        self.runner = FakeRunner(block_size=4)
        self.host_blocks = host_blocks
        self.tier: dict[int, dict[int, int]] = {}  # slot -> the KV copied there

    def execute_model(self, so):
        for block, slot in so.kv_offloads:  # the ranks' copies, offloads first
            self.tier[slot] = dict(self.runner.kv.get(block, {}))
        for slot, block in so.kv_restores:
            self.runner.kv[block] = dict(self.tier[slot])
        return super().execute_model(so)

    def kv_cache_info(self) -> dict:
        return {"num_host_kv_blocks": self.host_blocks, "kv_bytes_per_block_per_rank": 1} if self.host_blocks else {}


def make_core(model_dirs, host_blocks: int = 0, num_kv_blocks: int = 10) -> EngineCore:
    config = engine_config(model_dirs["llama"], num_kv_blocks=num_kv_blocks, block_size=4, max_model_len=32,
                           worker_restart_backoff_s=0.0)
    return EngineCore(config, executor=KVExecutor(host_blocks))


def add_all(core) -> None:
    for i, p in enumerate(PROMPTS):
        core.add_request(f"r{i}", p, PARAMS)


def snapshot(core, check: bool = True) -> dict:
    """Everything a plan may change, as plain values (the free queue's order aside)."""
    sched, kv = core.scheduler, core.scheduler.kv
    pool, tier = kv.block_pool, kv.host_tier
    if check:  # not in the middle of a plan
        check_ref_counts(kv)
    return {
        "running": [r.request_id for r in sched.running],
        "waiting": [r.request_id for r in sched.waiting],
        "requests": {i: (r.status, r.num_computed_tokens, r.num_tokens_sent, r.num_blocks_sent, r.num_cached_tokens,
                         r.num_preemptions, r.num_tokens, r.fork_source and r.fork_source.request_id)
                     for i, r in sched.requests.items()},
        "dropped": set(sched._dropped_ids),
        "stats": (sched.stats.num_preemptions, sched.stats.num_prompt_tokens, sched.stats.prefix_cache_queries,
                  sched.stats.prefix_cache_hits, sched.stats.queue_time.count, sched.stats.kv_peak_blocks),
        "tables": {i: [b.block_id for b in t] for i, t in kv.req_to_blocks.items()},
        "num_cached_blocks": dict(kv._num_cached_blocks),
        "free": pool.num_free_blocks,
        "cached": sorted((h, i) for h, blocks in pool.cached.items() for i in blocks),
        "evictions": pool.num_evictions,
        "pending": [(c.offload, c.block.block_id, c.entry.slot) for c in kv._pending_copies],
        "restoring": set(kv._restoring),
        "tier": None if tier is None else (sorted((e.block_hash, e.slot) for e in tier.resident()),
                                           set(tier._pinned), kv.tier_stats.queries, kv.tier_stats.hits,
                                           kv.tier_stats.offloaded),
    }


def assert_kv_is_what_the_cache_says(core) -> None:
    """Every cached block holds, on the 'ranks', the tokens its hash stands for: no block whose KV
    was never written is ever served from the cache."""
    kv = core.executor.runner.kv
    for blocks in core.scheduler.kv.block_pool.cached.values():
        for block in blocks.values():
            assert kv.get(block.block_id) == dict(enumerate(block.token_ids)), block


def reference(model_dirs, host_blocks: int = 0) -> dict:
    core = make_core(model_dirs, host_blocks)
    add_all(core)
    return {k: v.outputs[0].token_ids for k, v in run(core).items()}


class Fault:
    """Makes ``target.name`` raise ``exc`` on its ``at``-th call in an armed step (then disarms);
    ``when``: count only the calls made while it holds."""

    def __init__(self, monkeypatch, target, name: str, exc: BaseException, at: int, when=lambda: True) -> None:
        self.real, self.exc, self.at, self.when = getattr(target, name), exc, at, when
        self.armed, self.calls, self.fired = False, 0, 0
        monkeypatch.setattr(target, name, self)

    def __call__(self, *args, **kwargs):
        if self.armed and self.when():
            self.calls += 1
            if self.calls == self.at:
                self.armed = False
                self.fired += 1
                self.on_fire()
                raise self.exc
        return self.real(*args, **kwargs)

    def on_fire(self) -> None:
        pass


def drive_with_faults(core, fault: Fault, interrupt: bool = False) -> tuple[dict, list[dict]]:
    """Step to the end; before every step planned normally (every other one for an interruption,
    which leaves no request to plan alone), arm the fault: a step whose plan raised must leave
    everything as it was. Returns the final outputs and what each fired fault saw."""
    finals, seen = {}, []
    sched, kv = core.scheduler, core.scheduler.kv
    for n in range(400):
        if not core.has_unfinished_requests():
            break
        # not while a plan that raised is planned again whole (as a transient fault would: that retry runs)
        fault.armed, fault.calls = not core._suspects and not core._plan_retried and not (interrupt and n % 2), 0
        kv.begin_step()  # what the step starts with anyway (the last step's copies have run)
        before = snapshot(core)
        marks = fault.marks = (sched.stats.num_preemptions, kv.block_pool.num_evictions, len(kv._pending_copies),
                               kv.tier_stats.hits)
        fault.on_fire = lambda marks=marks, before=before: seen.append({
            "preempted": sched.stats.num_preemptions > marks[0], "evicted": kv.block_pool.num_evictions > marks[1],
            "tier_copies": len(kv._pending_copies) > marks[2], "restored": kv.tier_stats.hits > marks[3],
            "changed": snapshot(core, check=False) != before})
        fired = fault.fired
        if interrupt and fault.armed:
            try:
                outputs = core.step()
            except KeyboardInterrupt:
                outputs = None
        else:
            outputs = core.step()
        if fault.fired > fired:
            assert outputs in ([], None) and snapshot(core) == before
            assert core.dead is None
        for out in outputs or ():
            if out.finished:
                finals[out.request_id] = out
        assert_kv_is_what_the_cache_says(core)
    return finals, seen


@pytest.mark.parametrize("at", [1, 2, 3])
def test_an_allocation_that_raises_mid_plan_undoes_the_plan(model_dirs, monkeypatch, at):
    expected = reference(model_dirs)
    core = make_core(model_dirs)
    add_all(core)
    fault = Fault(monkeypatch, core.scheduler.kv, "allocate_slots", MemoryError("no memory"), at)
    finals, seen = drive_with_faults(core, fault)
    assert {k: v.outputs[0].token_ids for k, v in finals.items()} == expected
    assert all(v.error is None for v in finals.values()) and core.stats()["num_failed_requests"] == 0
    assert len(seen) >= 5
    if at > 1:  # faults that came after the plan had changed state
        assert sum(s["changed"] for s in seen) >= 3
    if at == 2:  # one after the plan had evicted a cached block (its hash given back)
        assert any(s["evicted"] for s in seen)


def test_an_allocation_that_raises_after_the_plan_preempted_gives_the_blocks_back(model_dirs, monkeypatch):
    """The plan preempted a running request (its blocks freed, some handed out and evicted), then
    an allocation raised: the preempted request has its very blocks back, the hashes come back."""
    expected = reference(model_dirs)
    core = make_core(model_dirs)
    add_all(core)
    sched = core.scheduler
    fault = Fault(monkeypatch, sched.kv, "allocate_slots", MemoryError("no memory"), 1,
                  when=lambda: sched.stats.num_preemptions > fault.marks[0])
    finals, seen = drive_with_faults(core, fault)
    assert {k: v.outputs[0].token_ids for k, v in finals.items()} == expected
    assert seen and all(s["preempted"] and s["changed"] for s in seen)
    assert core.stats()["num_failed_requests"] == 0 and core.stats()["num_blocks_in_use"] == 0
    assert core.stats()["num_blocks_in_use"] == 0


def test_the_host_tier_swap_planning_that_raises_is_undone(model_dirs, monkeypatch):
    expected = reference(model_dirs, host_blocks=16)
    assert expected == reference(model_dirs)
    core = make_core(model_dirs, host_blocks=16)
    add_all(core)
    # the second tier lookup of a plan raises: after the first one restored a block (or the pool's
    # evictions recorded offloads)
    fault = Fault(monkeypatch, core.scheduler.kv.host_tier, "lookup", RuntimeError("tier index broken"), 2)
    finals, seen = drive_with_faults(core, fault)
    assert {k: v.outputs[0].token_ids for k, v in finals.items()} == expected
    assert seen and any(s["tier_copies"] for s in seen) and any(s["restored"] for s in seen)
    assert core.stats()["num_failed_requests"] == 0 and core.stats()["num_blocks_in_use"] == 0


def test_a_grammar_bitmask_that_raises_is_undone(model_dirs, monkeypatch):
    """The bitmask is filled last, once every request's counters have advanced."""
    expected = reference(model_dirs)
    core = make_core(model_dirs)
    add_all(core)
    sched = core.scheduler
    sched.num_constrained = 1  # as if a constrained request were in flight: the fill runs every step
    monkeypatch.setattr(sched, "_fill_grammar_bitmask", lambda output: None)
    fault = Fault(monkeypatch, sched, "_fill_grammar_bitmask", ValueError("bad matcher state"), 1)
    finals, seen = drive_with_faults(core, fault)
    assert {k: v.outputs[0].token_ids for k, v in finals.items()} == expected
    assert len(seen) >= 5 and all(s["changed"] for s in seen)
    assert core.stats()["num_failed_requests"] == 0


def test_ctrl_c_while_planning_rolls_back_and_goes_on(model_dirs, monkeypatch):
    expected = reference(model_dirs)
    core = make_core(model_dirs)
    add_all(core)
    fault = Fault(monkeypatch, core.scheduler.kv, "allocate_slots", KeyboardInterrupt(), 2)
    finals, seen = drive_with_faults(core, fault, interrupt=True)
    assert {k: v.outputs[0].token_ids for k, v in finals.items()} == expected
    assert len(seen) >= 5 and core.stats()["num_failed_steps"] == 0  # interruptions are not failures


def test_a_plan_that_fails_for_one_request_fails_it_alone(model_dirs, monkeypatch):
    """A request whose planning always raises (a poisonous request): planned alone it fails with an
    error, the others complete exactly; nothing hangs, nothing leaks."""
    expected = reference(model_dirs)
    core = make_core(model_dirs, num_kv_blocks=64)
    add_all(core)
    core.add_request("bad", [7, 7, 7, 7, 7], PARAMS)
    real = core.scheduler.kv.allocate_slots

    def allocate(request, *args, **kwargs):
        if request.request_id.startswith("bad"):
            raise IndexError("poisonous")
        return real(request, *args, **kwargs)

    monkeypatch.setattr(core.scheduler.kv, "allocate_slots", allocate)
    finals = run(core)
    assert finals["bad"].error == "the engine failed while running this request (IndexError)"
    assert {k: v.outputs[0].token_ids for k, v in finals.items() if k != "bad"} == expected
    assert core.stats()["num_blocks_in_use"] == 0 and core.dead is None


def test_an_update_that_raises_fails_its_request_alone(model_dirs, monkeypatch):
    """Appending one request's token raises after the step ran: that request ends with an error,
    the others of the same steps complete exactly, its blocks are freed."""
    core = make_core(model_dirs, num_kv_blocks=64)
    add_all(core)
    expected = reference(model_dirs)
    real = core.scheduler._check_stop

    def check_stop(request):
        if request.request_id == "r1#0" and request.num_output_tokens == 3:
            raise RuntimeError("stop check broke")
        return real(request)

    monkeypatch.setattr(core.scheduler, "_check_stop", check_stop)
    finals = run(core)
    assert finals["r1"].error == "the engine failed while running this request (RuntimeError)"
    assert finals["r1"].outputs[0].finish_reason == "error"
    assert {k: v.outputs[0].token_ids for k, v in finals.items() if k != "r1"} == \
        {k: v for k, v in expected.items() if k != "r1"}
    assert core.stats()["num_blocks_in_use"] == 0 and not core.scheduler.requests and not core.outputs.requests


def test_taking_outputs_that_raises_ends_the_step_requests_without_hanging(model_dirs, monkeypatch):
    """Past the per-request guards (here: the output processor itself raises once): the step's
    unfinished requests end with an error, the engine stays alive, nothing is left held."""
    core = make_core(model_dirs, num_kv_blocks=64)
    add_all(core)
    real, calls = core.outputs.process, []

    def process(core_outputs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("output processing broke")
        return real(core_outputs)

    monkeypatch.setattr(core.outputs, "process", process)
    finals = run(core)
    assert sorted(finals) == [f"r{i}" for i in range(len(PROMPTS))]
    failed = [k for k, v in finals.items() if v.error is not None]
    assert failed and all(finals[k].error == "the engine failed while running this request (RuntimeError)"
                          for k in failed)
    assert core.dead is None and core.stats()["num_blocks_in_use"] == 0
    assert not core.scheduler.requests and not core.outputs.requests
