"""The scheduler against a model-free runner: budgets, chunked prefill, mixed batches, preemption,
prefix statistics, n > 1 forks, aborts."""

from __future__ import annotations

from engine.request import RequestStatus
from engine.scheduler import Scheduler
from tests.engine.fakes import FakeRunner, make_request


def make_scheduler(num_blocks=64, block_size=4, caching=True, max_num_seqs=8, budget=32, max_model_len=256):
    return Scheduler(num_kv_blocks=num_blocks, block_size=block_size, enable_prefix_caching=caching,
                     max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len)


def step(sched, runner):
    so = sched.schedule()
    out = runner.execute_model(so)
    return so, sched.update_from_output(so, out)


def test_long_prompt_is_chunked_under_the_budget_then_decodes():
    sched, runner = make_scheduler(budget=32), FakeRunner()
    sched.add_request(make_request("a", list(range(1, 101)), max_tokens=3))
    chunks = []
    while sched.has_unfinished_requests():
        so, _ = step(sched, runner)
        chunks.append(so.num_scheduled_tokens.get("a"))
    assert chunks == [32, 32, 32, 4, 1, 1]


def test_decodes_go_first_and_prefill_fills_the_rest_of_the_budget():
    sched, runner = make_scheduler(budget=16), FakeRunner()
    sched.add_request(make_request("a", list(range(1, 6)), max_tokens=10))
    step(sched, runner)
    sched.add_request(make_request("b", list(range(100, 130)), max_tokens=10))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 15}
    assert [d.req_id for d in so.scheduled_cached_reqs] == ["a"]
    assert [n.req_id for n in so.scheduled_new_reqs] == ["b"]


def test_max_num_seqs_bounds_the_running_set():
    sched, runner = make_scheduler(max_num_seqs=2, budget=100), FakeRunner()
    for i in range(3):
        sched.add_request(make_request(str(i), [i + 1] * 5))
    so = sched.schedule()
    assert sorted(so.num_scheduled_tokens) == ["0", "1"]
    assert len(sched.waiting) == 1


def test_newest_running_request_is_preempted_and_recomputed():
    sched, runner = make_scheduler(num_blocks=7, block_size=4, budget=64, max_model_len=24), FakeRunner()  # 6 usable
    sched.add_request(make_request("old", list(range(1, 9)), max_tokens=12))  # 2 blocks, grows
    sched.add_request(make_request("new", list(range(20, 28)), max_tokens=12))
    preempted_at = None
    finished = {}
    for i in range(60):
        so, outs = step(sched, runner)
        if sched.stats.num_preemptions and preempted_at is None:
            preempted_at = i
            assert "new" in so.finished_req_ids  # the workers drop it
            assert sched.requests["new"].status == RequestStatus.PREEMPTED
            assert sched.running[0].request_id == "old"
        for o in outs:
            if o.finish_reason:
                finished[o.req_id] = o.finish_reason
        if not sched.has_unfinished_requests():
            break
    assert preempted_at is not None
    assert finished == {"old": "length", "new": "length"}
    assert sched.kv.block_pool.num_free_blocks == 6


def test_prefix_statistics_count_first_schedules_only():
    sched, runner = make_scheduler(num_blocks=7, block_size=4, budget=64, max_model_len=24), FakeRunner()
    sched.add_request(make_request("a", list(range(1, 10)), max_tokens=2))
    while sched.has_unfinished_requests():
        step(sched, runner)
    sched.add_request(make_request("b", list(range(1, 10)), max_tokens=2))
    step(sched, runner)
    assert (sched.stats.prefix_cache_queries, sched.stats.prefix_cache_hits) == (18, 8)
    # preempt-and-recompute never adds to either count
    sched2, runner2 = make_scheduler(num_blocks=7, block_size=4, budget=64, max_model_len=24), FakeRunner()
    sched2.add_request(make_request("x", list(range(1, 9)), max_tokens=12))
    sched2.add_request(make_request("y", list(range(20, 28)), max_tokens=12))
    while sched2.has_unfinished_requests():
        step(sched2, runner2)
    assert sched2.stats.num_preemptions >= 1
    assert sched2.stats.prefix_cache_queries == 16


def test_same_step_requests_share_a_prefix_being_computed():
    sched, runner = make_scheduler(budget=64), FakeRunner()
    sched.add_request(make_request("a", list(range(1, 14))))
    sched.add_request(make_request("b", list(range(1, 13)) + [99]))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 13, "b": 1}
    new = {n.req_id: n for n in so.scheduled_new_reqs}
    assert new["b"].num_computed_tokens == 12
    assert new["b"].block_ids[:3] == new["a"].block_ids[:3]


def test_fork_children_wait_for_the_prompt_then_share_its_blocks():
    for caching in (True, False):
        sched, runner = make_scheduler(caching=caching, budget=64), FakeRunner()
        first = make_request("p#0", list(range(1, 11)))
        sched.add_request(first)
        sched.add_request(make_request("p#1", list(range(1, 11)), fork_source=first))
        so, _ = step(sched, runner)
        assert so.num_scheduled_tokens == {"p#0": 10}
        so, _ = step(sched, runner)
        assert so.num_scheduled_tokens == {"p#0": 1, "p#1": 2}
        child = next(n for n in so.scheduled_new_reqs if n.req_id == "p#1")
        assert child.block_ids[:2] == sched.kv.get_block_ids("p#0")[:2]
        assert sched.stats.prefix_cache_hits == 0


def test_abort_frees_blocks_and_tells_the_workers():
    sched, runner = make_scheduler(), FakeRunner()
    sched.add_request(make_request("a", list(range(1, 20)), max_tokens=50))
    sched.add_request(make_request("b", list(range(30, 40)), max_tokens=50))
    step(sched, runner)
    sched.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests()
    assert sched.kv.block_pool.num_free_blocks == 63
    so = sched.schedule()
    assert so.is_empty and so.finished_req_ids == {"a", "b"}


def test_stop_on_eos_respects_min_tokens_and_ignore_eos():
    from engine.sampling_params import SamplingParams
    from engine.request import Request
    from engine.messages import ModelRunnerOutput

    sched = make_scheduler()
    params = SamplingParams(max_tokens=10, min_tokens=2)
    r = Request("r", [5, 6], params, eos_token_ids=frozenset({0}), block_size=4, max_tokens=10)
    sched.add_request(r)
    for token, expect in ((0, None), (0, "stop")):
        so = sched.schedule()
        outs = sched.update_from_output(so, ModelRunnerOutput(["r"], [[token]], [None]))
        assert outs[0].finish_reason == expect


def test_kv_occupancy_counts_shared_blocks_once_and_empty_tail_slots():
    """Two requests share a 3-block prefix (12 tokens, block size 4); each holds its own tail. The
    empty slots are exactly the unfilled ends of their last blocks, and the peak keeps its waste."""
    sched, runner = make_scheduler(budget=64), FakeRunner()
    prefix = list(range(1, 13))
    sched.add_request(make_request("a", prefix + [50], max_tokens=4))
    step(sched, runner)  # a: 13 tokens computed -> 4 blocks, 3 slots empty
    assert sched.kv_occupancy() == (4, 3)
    sched.add_request(make_request("b", prefix + [60, 61], max_tokens=4))
    step(sched, runner)  # a: 14 tokens (2 empty); b: hit on 3 blocks + 2 own tokens in a new block (2 empty)
    used, empty = sched.kv_occupancy()
    assert (used, empty) == (5, 4)
    assert sched.stats.kv_peak_blocks == 5 and sched.stats.kv_waste_at_peak == 4 / (5 * 4)
    while sched.has_unfinished_requests():
        step(sched, runner)
    assert sched.kv_occupancy() == (0, 0)
    assert sched.stats.kv_peak_blocks >= 5  # the peak outlives the requests
