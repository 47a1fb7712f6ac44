"""The scheduler with a hybrid KV layout (``engine/window_kv.py``): window layers release their pages
behind the window, prefix hits reuse attached pages and are cut back where pages went, a failed plan
that lost a preempted request's pages preempts it again, the pool check counts window pages. Driven
with ``WindowRunner``, which reads every window position through the tables sent to it."""

from __future__ import annotations

import logging

import pytest

from engine.block_pool import BlockPool
from engine.core import EngineCore
from engine.executor import Executor
from engine.kv_layout import KVLayout
from engine.llm import engine_config
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.window_kv import check_pool_fits, max_pages_per_sequence
from tests.engine.fakes import make_request
from tests.engine.window_fakes import WindowRunner, window_pool_check

GEMMA3 = KVLayout(6, 40, (0, 1, 2, 3, 4))  # gemma3 tiny: 1 full layer, G = 5, window 40
GEMMA2 = KVLayout(4, 48, (0, 2))  # gemma2 tiny: 2 + 2, G = 1, window 48


def make(layout, num_blocks=400, bs=8, budget=64, max_len=512, max_num_seqs=8, caching=True):
    sched = Scheduler(num_kv_blocks=num_blocks, block_size=bs, enable_prefix_caching=caching, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=budget, max_model_len=max_len, kv_layout=layout)
    return sched, WindowRunner(bs, layout)


def step(sched, runner):
    so = sched.schedule()
    if not so.is_empty:
        sched.update_from_output(so, runner.execute_model(so))
    window_pool_check(sched.kv)
    runner.check_mirror(sched)
    return so


def drain(sched, runner, limit=2000):
    for _ in range(limit):
        if not sched.has_unfinished_requests():
            return
        step(sched, runner)
    raise AssertionError("requests never finished")


def prompt(seed, n):
    return [1 + (seed * 7 + i * 13) % 47 for i in range(n)]


@pytest.mark.parametrize("layout", [GEMMA3, GEMMA2])
def test_a_long_sequence_holds_its_blocks_and_the_window_pages_only(layout):
    bs, length, G = 8, 300, layout.num_window_groups
    sched, runner = make(layout)
    request = make_request("a", prompt(1, length), max_tokens=60, block_size=bs)
    sched.add_request(request)
    pool, most, last = sched.kv.block_pool, 0, 0
    while sched.has_unfinished_requests():
        so = sched.schedule()
        table = sched.kv.req_to_blocks["a"]
        s = request.num_computed_tokens - so.num_scheduled_tokens["a"]  # at the plan's start
        last = len(table) + G * (len(table) - layout.first_needed_block(s, bs))
        assert sched.kv.pages_held("a") == last == pool.num_used_blocks  # nothing else holds a page
        assert pool.num_held_pages == last - len(table)
        most = max(most, last)
        sched.update_from_output(so, runner.execute_model(so))
        window_pool_check(sched.kv)
        runner.check_mirror(sched)
    # 359 tokens computed: 45 blocks, the window pages of the last window's blocks only
    assert most <= max_pages_per_sequence(layout, bs, 360, 64) < 45 * (1 + G)
    # a decode step spans the window and one more block (a fork's source may keep one block more)
    assert last <= max_pages_per_sequence(layout, bs, 359, 1) == 45 + G * ((layout.window + 3 * bs - 2) // bs)
    assert runner.reads > 0 and sched.stats.num_preemptions == 0 and pool.num_held_pages == 0


def finished_prefix(layout, bs=8, n=120):
    """A scheduler in which a 120-token prompt ran and finished (its full blocks cached)."""
    sched, runner = make(layout, bs=bs)
    sched.add_request(make_request("a", prompt(2, n), max_tokens=1, block_size=bs))
    drain(sched, runner)
    return sched, runner


def test_a_prefix_hit_reuses_the_attached_pages():
    layout, bs = GEMMA3, 8
    sched, runner = finished_prefix(layout)
    cached = [b for b in sched.kv.block_pool.blocks[1:] if b.block_hash is not None]
    assert len(cached) == 15 and all(b.window_pages is not None for b in cached)  # pages followed them
    attached = {b.block_id: [p.block_id for p in b.window_pages] for b in cached}
    sched.add_request(make_request("b", prompt(2, 120) + [5, 6, 7], max_tokens=2, block_size=bs))
    so = sched.schedule()
    new = so.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 120  # every full block hit
    first = layout.first_needed_block(120, bs)  # (120 - 40 + 1) // 8 = 10
    assert first == 10
    for i, block_id in enumerate(new.block_ids[:15]):
        ids = [w[i] for w in new.window_block_ids]
        assert ids == (attached[block_id] if i >= first else [0] * 5)  # the very pages, else none held
    sched.update_from_output(so, runner.execute_model(so))
    window_pool_check(sched.kv)
    drain(sched, runner)
    assert runner.reads > 0


def test_a_hit_is_cut_back_where_pages_were_handed_out():
    layout, bs = GEMMA3, 8
    sched, runner = finished_prefix(layout)
    pool, kv = sched.kv.block_pool, sched.kv
    request = make_request("b", prompt(2, 120) + [9], max_tokens=2, block_size=bs)
    hits, _ = kv.get_computed_blocks(request)
    assert len(hits) == 15
    victim = hits[12].window_pages[3]  # a page of block 12, inside the window of a 15-block hit
    queue = list(pool.free_queue)
    taken = pool.get_new_blocks(queue.index(victim) + 1)  # hands out every free block up to it
    assert hits[12].window_pages is None

    def longest(blocks):  # the rule, by brute force
        return max(k for k in range(len(blocks) + 1)
                   if all(blocks[i].window_pages is not None for i in range(layout.first_needed_block(k * bs, bs), k)))

    expect = longest(hits)
    assert expect <= 12
    cut, num_cached = kv.get_computed_blocks(request)
    assert len(cut) == expect and num_cached == expect * bs
    pool.free_blocks(taken)  # given back, as if their requests had finished
    window_pool_check(kv)
    sched.add_request(request)
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == expect * bs
    sched.update_from_output(so, runner.execute_model(so))
    window_pool_check(kv)
    drain(sched, runner)


def test_a_fork_shares_the_prompt_with_its_window_pages():
    layout, bs = GEMMA2, 8
    sched, runner = make(layout, bs=bs)
    first = make_request("p#0", prompt(3, 100), max_tokens=6, block_size=bs)
    sched.add_request(first)
    sched.add_request(make_request("p#1", prompt(3, 100), max_tokens=6, block_size=bs, fork_source=first))
    drain(sched, runner)
    assert sched.stats.num_preemptions == 0 and runner.reads > 0


def test_a_fork_without_prefix_caching_still_shares_the_prompt():
    """The source keeps the window pages its waiting sibling's fork reads (uncached blocks' pages are
    freed, not kept, once released): the sibling starts where a plain layout's would."""
    layout, bs = GEMMA3, 8
    starts = {}
    for name, lay in (("hybrid", layout), ("plain", KVLayout.plain(6))):
        sched, runner = make(lay, bs=bs, budget=256, caching=False)
        first = make_request("p#0", prompt(3, 200), max_tokens=6, block_size=bs)
        child = make_request("p#1", prompt(3, 200), max_tokens=6, block_size=bs, fork_source=first)
        sched.add_request(first)
        sched.add_request(child)
        seen = []
        for _ in range(50):
            so = sched.schedule()
            sched.update_from_output(so, runner.execute_model(so))
            if lay.hybrid:
                window_pool_check(sched.kv)
            seen += [(r.req_id, r.num_computed_tokens) for r in so.scheduled_new_reqs]
            if not sched.has_unfinished_requests():
                break
        starts[name] = dict(seen)["p#1"]
    assert starts == {"hybrid": 192, "plain": 192}  # (200 - 1) // 8 blocks


def test_a_fork_source_alone_in_the_smallest_pool_still_finishes():
    """One sequence at a time, caching off, the pool sized for one sequence: the source keeps what its
    waiting sibling would fork only until it decodes past its prompt, so it never outgrows the pool
    (keeping them for good, it preempted itself at every step: a livelock)."""
    layout, bs, budget = KVLayout(6, 9, (0, 1, 2, 3, 4)), 4, 4
    num_blocks = max_pages_per_sequence(layout, bs, 40, budget) + 1
    sched, runner = make(layout, num_blocks=num_blocks, bs=bs, budget=budget, max_len=40, max_num_seqs=1,
                         caching=False)
    first = make_request("p#0", prompt(6, 10), max_tokens=12, block_size=bs, ignore_eos=True)
    sched.add_request(first)
    sched.add_request(make_request("p#1", prompt(6, 10), max_tokens=12, block_size=bs, ignore_eos=True,
                                   fork_source=first))
    drain(sched, runner, limit=200)
    assert sched.stats.num_preemptions == 0 and runner.reads > 0


def test_a_failed_plan_gives_a_request_it_preempted_its_own_pages_back():
    """The plan preempts "new" (its partial last block has no hash: its pages are freed) and raises
    before handing any page out: undone, "new" runs on with its tokens and the same pages."""
    layout, bs = GEMMA2, 4
    sched, runner = make(layout, num_blocks=10, bs=bs, budget=16, max_len=40, max_num_seqs=2)
    sched.add_request(make_request("old", prompt(4, 8), max_tokens=3, block_size=bs))
    sched.add_request(make_request("new", prompt(5, 5), max_tokens=3, block_size=bs))
    step(sched, runner)
    old, new = sched.running
    pages = sched.kv.window_block_ids("new")
    preempt = sched._preempt

    def preempt_then_fail(request, counted=True):
        preempt(request, counted)
        raise RuntimeError("fault")

    sched._preempt = preempt_then_fail
    with pytest.raises(RuntimeError):
        sched.schedule()
    del sched._preempt
    assert [r.request_id for r in sched.running] == ["old", "new"]
    assert new.status == RequestStatus.RUNNING and new.num_computed_tokens == 5 and new.num_preemptions == 0
    assert sched.kv.window_block_ids("new") == pages
    window_pool_check(sched.kv)


def test_pool_exhaustion_preempts_rather_than_deadlocks():
    layout, bs, budget = GEMMA3, 8, 32
    need = max_pages_per_sequence(layout, bs, 256, budget)
    sched, runner = make(layout, num_blocks=need + 20, bs=bs, budget=budget, max_len=256)
    for i in range(6):
        sched.add_request(make_request(f"r{i}", prompt(10 + i, 150 + 7 * i), max_tokens=40, block_size=bs))
    drain(sched, runner)
    assert sched.stats.num_preemptions > 0
    pool = sched.kv.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks and pool.num_held_pages == 0


def test_a_failed_plan_that_lost_a_preempted_requests_pages_preempts_it_again():
    layout, bs = GEMMA2, 4  # G = 1: a block takes 2 pages (no release: the window is past max_model_len)
    sched, runner = make(layout, num_blocks=10, bs=bs, budget=16, max_len=40, max_num_seqs=2)
    sched.add_request(make_request("old", prompt(4, 8), max_tokens=3, block_size=bs))
    sched.add_request(make_request("new", prompt(5, 5), max_tokens=3, block_size=bs))
    step(sched, runner)  # 2 + 2 blocks, 8 of the 9 pages
    old, new = sched.running
    assert sched.kv.block_pool.num_free_blocks == 1 and old.num_computed_tokens == 8
    # "old"'s next token needs a block: the plan preempts "new" (its last block's page freed, then handed
    # out to "old"), then raises
    sched._track_kv_peak = lambda: (_ for _ in ()).throw(RuntimeError("fault"))
    with pytest.raises(RuntimeError):
        sched.schedule()
    del sched._track_kv_peak
    # "new"'s freed pages went to "old"'s new block: the plan is undone, and "new" is recomputed
    assert [r.request_id for r in sched.running] == ["old"]
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0 and new.num_preemptions == 1
    assert "new" not in sched.kv.req_to_blocks and sched.waiting[0] is new
    window_pool_check(sched.kv)
    drain(sched, runner)


def test_the_pool_must_hold_one_sequence_with_its_window_pages():
    layout, bs = GEMMA3, 8
    # 512 tokens = 64 blocks; window 40 + chunk 64 - 1 = 103 positions span 14 blocks at most: 64 + 5 * 14
    assert max_pages_per_sequence(layout, bs, 512, 64) == 64 + 5 * 14
    assert max_pages_per_sequence(KVLayout.plain(6), bs, 512, 64) == 64
    assert max_pages_per_sequence(layout, bs, 48, 64) == 6 + 5 * 6  # never more than every block
    check_pool_fits(64 + 70 + 1, bs, 512, layout, 64)
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len=512 with the hybrid KV layout"):
        check_pool_fits(64 + 70, bs, 512, layout, 64)
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len=512; give more"):
        check_pool_fits(64, bs, 512, KVLayout.plain(6), 64)


def test_a_hybrid_layout_refuses_the_host_tier_and_a_plain_one_sends_no_window_tables():
    with pytest.raises(ValueError, match="host KV tier"):
        Scheduler(num_kv_blocks=64, block_size=8, enable_prefix_caching=True, max_num_seqs=4,
                  max_num_batched_tokens=64, max_model_len=256, num_host_kv_blocks=16, kv_layout=GEMMA3)
    sched, runner = make(KVLayout.plain(6))
    sched.add_request(make_request("a", prompt(6, 30), max_tokens=2, block_size=8))
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].window_block_ids == [] and sched.kv.pages_held("a") == 4
    assert sched.kv.block_pool.num_held_pages == 0
    sched.update_from_output(so, runner.execute_model(so))
    drain(sched, runner)


class WindowExecutor(Executor):
    """WindowRunner behind the Executor interface; a lost rank (``restart``) comes back empty."""

    def __init__(self, layout, block_size) -> None:
        self.layout, self.block_size = layout, block_size
        self.runner = WindowRunner(block_size, layout)
        self.shut = False

    def determine_num_kv_blocks(self) -> int:
        raise AssertionError("the tests give num_kv_blocks")

    def initialize_kv_cache(self, num_blocks: int) -> None:
        pass

    def execute_model(self, so):
        return self.runner.execute_model(so)

    def restart(self) -> None:
        self.runner = WindowRunner(self.block_size, self.layout)

    def shutdown(self) -> None:
        self.shut = True


def test_the_engine_runs_gemma3_hybrid_and_reports_its_window_pages(caplog):
    from tests.gemma_models import gemma_dir

    bs, length = 8, 256
    config = engine_config(gemma_dir("gemma3"), block_size=bs, num_kv_blocks=200, max_model_len=length,
                           max_num_batched_tokens=64, worker_restart_backoff_s=0.0)
    assert config.kv_layout() == GEMMA3 and max_pages_per_sequence(GEMMA3, bs, length, 64) == 32 + 5 * 14
    executor = WindowExecutor(GEMMA3, bs)
    with caplog.at_level(logging.INFO, logger="engine.core"):
        core = EngineCore(config, executor=executor)
    assert GEMMA3.describe() in caplog.text
    for i in range(3):
        core.add_request(f"r{i}", prompt(20 + i, 150), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    core.step()
    stats = core.stats()
    assert stats["kv_window_groups"] == 5
    held = sum(core.scheduler.kv.pages_held(r.request_id) for r in core.scheduler.running)
    assert stats["kv_window_pages_held"] == core.scheduler.kv.block_pool.num_held_pages > 0
    assert held == stats["num_blocks_in_use"]  # no prefix shared: every page is one request's
    core.executor.restart()  # the ranks are lost: every request is recomputed, the prefix cache forgotten
    core.scheduler.recompute_all()
    window_pool_check(core.scheduler.kv)
    assert core.scheduler.kv.block_pool.num_held_pages == 0 and not core.scheduler.running
    finished = 0
    for _ in range(500):
        if not core.has_unfinished_requests():
            break
        finished += sum(o.finished for o in core.step())
        window_pool_check(core.scheduler.kv)
    assert finished == 3 and core.stats()["kv_window_pages_held"] == 0 and executor.runner.reads > 0
    with pytest.raises(ValueError, match="with the hybrid KV layout"):
        EngineCore(engine_config(gemma_dir("gemma3"), block_size=bs, num_kv_blocks=32 + 70, max_model_len=length,
                                 max_num_batched_tokens=64), executor=(refused := WindowExecutor(GEMMA3, bs)))
    assert refused.shut


def test_a_hit_takes_the_copy_of_a_block_whose_pages_are_attached():
    pool = BlockPool(16, True)
    plain, paged, page = pool.get_new_blocks(3)
    for block in (plain, paged):
        pool.cache_block(block, b"h" * 32, (1, 2))
    pool.attach(paged, [page])
    pool.release(paged)  # cached: its page stays attached, free
    pool.free_blocks([plain, paged])
    assert pool.get_cached_block(b"h" * 32, (1, 2)) is paged  # not the first copy, which has none
    pool.check_window_invariants(1)
    pool.touch([plain])
    assert pool.get_cached_block(b"h" * 32, (1, 2)) is paged  # pages before being in use
