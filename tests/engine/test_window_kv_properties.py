"""Property test: the scheduler machine of test_scheduler_properties (add / step / failed steps / steps
alone / abort / finish, with n > 1 forks and shared prefixes) and plans that raise midway, with a
hybrid KV layout whose window (a few blocks) the sequences cross: after every rule the pool and
window invariants hold, the window ids the ranks hold from each request's window on are exactly the
attached pages, and every window position a step reads (``WindowRunner``) holds its KV."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import initialize, invariant, rule

from engine.kv_layout import KVLayout
from engine.request import RequestStatus
from engine.scheduler import Scheduler
from engine.window_kv import max_pages_per_sequence
from tests.engine.test_scheduler_properties import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    SchedulerMachine,
)
from tests.engine.window_fakes import WindowRunner, window_pool_check

LAYOUTS = [KVLayout(6, 9, (0, 1, 2, 3, 4)), KVLayout(4, 6, (0, 2)), KVLayout(3, 5, (1,))]  # G = 5, 1, 1


class PlanFault(Exception):
    pass


class WindowMachine(SchedulerMachine):
    @initialize(layout=st.sampled_from(LAYOUTS), caching=st.booleans(), extra=st.integers(0, 6),
                budget=st.integers(4, 32), max_num_seqs=st.integers(1, 5))
    def setup(self, layout, caching, extra, budget, max_num_seqs):
        num_blocks = max_pages_per_sequence(layout, BLOCK_SIZE, MAX_MODEL_LEN, budget) + 1 + extra
        self.sched = Scheduler(num_kv_blocks=num_blocks, block_size=BLOCK_SIZE, enable_prefix_caching=caching,
                               max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                               max_model_len=MAX_MODEL_LEN, kv_layout=layout)
        self.runner = WindowRunner(BLOCK_SIZE, layout)
        self.next_id = 0
        self.budget = budget

    @rule(at=st.integers(1, 6), method=st.sampled_from(["allocate_slots", "get_computed_blocks",
                                                         "get_forkable_blocks"]),
          alone=st.booleans(), data=st.data())
    def plan_raises(self, at, method, alone, data):
        """A plan raises at a random call: it is undone whole, but for a request it preempted whose
        window pages it handed out meanwhile, which is preempted again (to be recomputed)."""
        sched = self.sched
        only = data.draw(st.sampled_from(sorted(sched.requests))) if alone and sched.requests else None
        real, calls = getattr(sched.kv, method), []

        def fault(*args, **kwargs):
            calls.append(1)
            if len(calls) == at:
                raise PlanFault
            return real(*args, **kwargs)

        setattr(sched.kv, method, fault)
        # what the plan starts from: the releases it makes first stand (engine/window_kv.py)
        sched.kv.begin_step()
        sched.kv.release_behind_windows(sched.running)
        running = list(sched.running)
        tables = {r.request_id: list(sched.kv.req_to_blocks[r.request_id]) for r in running}
        computed = {r.request_id: r.num_computed_tokens for r in running}
        try:
            so = sched.schedule(only=only)
        except PlanFault:
            so = None
        finally:
            del sched.kv.__dict__[method]
        if so is None:
            for request in running:
                rid = request.request_id
                if request.status == RequestStatus.RUNNING:
                    assert sched.kv.req_to_blocks[rid] == tables[rid] and request.num_computed_tokens == computed[rid]
                else:  # lost its pages: back to the head of the queue, holding nothing
                    assert request.status == RequestStatus.PREEMPTED and request.num_computed_tokens == 0
                    assert rid not in sched.kv.req_to_blocks and request in sched.waiting
            assert [r for r in sched.running] == [r for r in running if r.status == RequestStatus.RUNNING]
        elif not so.is_empty:
            sched.update_from_output(so, self.runner.execute_model(so))

    @invariant()
    def pool_is_consistent(self):
        kv = self.sched.kv
        window_pool_check(kv)
        pool = kv.block_pool
        assert sum(len(b) for b in pool.cached.values()) == pool.num_cached_blocks
        assert pool.num_cached_blocks == sum(b.block_hash is not None for b in pool.blocks)
        for blocks in pool.cached.values():  # a cached block holds the KV of its tokens (full layers)
            for block in blocks.values():
                written = [self.runner.kv.get((0, block.block_id, i)) for i in range(BLOCK_SIZE)]
                assert tuple(c and c[1][-1] for c in written) == block.token_ids, block
        assert set(kv.req_to_blocks) <= set(self.sched.requests)

    @invariant()
    def window_tables_mirror_the_pages(self):
        self.runner.check_mirror(self.sched)


WindowMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestWindowProperties = WindowMachine.TestCase


class _Draws:
    """``data`` for a rule replayed by hand: its draws, in order."""

    def __init__(self, *values):
        self.values = list(values)

    def draw(self, strategy):
        return self.values.pop(0)


def _replay(setup: dict, rules: list[tuple[str, dict]]) -> WindowMachine:
    machine = WindowMachine()
    machine.setup(**setup)
    for name, kwargs in rules:
        getattr(machine, name)(**kwargs)
        machine.pool_is_consistent()
        machine.tables_cover_computed_tokens_and_match_hashes()
        machine.window_tables_mirror_the_pages()
        machine.workers_mirror_the_scheduler()
    machine.teardown()
    return machine


def test_a_failed_plan_that_evicted_cached_blocks_gives_their_hashes_back_without_the_plans_pages():
    """Found by the machine: a plan hands out cached blocks (one as a new table block, one as its window
    page) and raises; undone, each gets its hash back, and neither keeps the plan's pages (never written)."""
    machine = _replay(
        dict(layout=LAYOUTS[0], caching=True, extra=0, budget=10, max_num_seqs=2),
        [("add", dict(eos=False, length=13, max_tokens=3, n=1, salt=None, tail=0, text=1))]
        + [("step", {})] * 3
        + [("add", dict(eos=False, length=20, max_tokens=1, n=3, salt=None, tail=0, text=0))]
        + [("step", {})] * 3
        + [("plan_raises", dict(alone=False, at=2, data=_Draws(), method="allocate_slots"))])
    assert machine.runner.reads > 0


def test_a_plan_undone_after_a_failed_step_alone_reads_every_window_position_right():
    """Found by the machine (CI): forks, failed steps alone and plans raising in each call; every window
    position read afterwards holds its KV."""
    machine = _replay(
        dict(layout=LAYOUTS[1], budget=26, extra=5, max_num_seqs=5, caching=True),
        [("add", dict(eos=False, length=36, max_tokens=2, n=3, salt=None, tail=0, text=0)), ("step", {}),
         ("add", dict(eos=False, length=26, max_tokens=12, n=3, salt=None, tail=0, text=1))]
        + [("step", {})] * 5
        + [("plan_raises", dict(alone=False, at=1, data=_Draws(), method="allocate_slots")),
           ("add", dict(eos=False, length=1, max_tokens=1, n=1, salt=None, tail=0, text=0)),
           ("step_alone", dict(data=_Draws("r2#0"), fail=True)),
           ("plan_raises", dict(alone=False, at=2, data=_Draws(), method="get_computed_blocks")),
           ("plan_raises", dict(alone=False, at=3, data=_Draws(), method="allocate_slots")),
           ("plan_raises", dict(alone=False, at=6, data=_Draws(), method="get_forkable_blocks")),
           ("finish_by_stop_string", dict(data=_Draws("r1#0"))), ("step", {})])
    assert machine.runner.reads > 0


def test_a_failed_plan_that_made_a_preempted_requests_block_a_page_frees_that_block_once():
    """Found by the machine: with the pool full, a plan preempts the newest request (one block, one page)
    and hands its page out as a new table block and its block as that block's window page, then raises.
    Undone, the plan's block gives back its pages at once: the preempted request gets its block back as a
    block only (its page is lost, so it is preempted again, for recompute), and the block is not freed
    a second time as the plan's page (it was: a double free)."""
    machine = _replay(
        dict(layout=LAYOUTS[2], caching=False, extra=1, budget=11, max_num_seqs=4),
        [("add", dict(eos=False, length=30, max_tokens=3, n=2, salt=None, tail=0, text=0))]
        + [("step", {})] * 2
        + [("add", dict(eos=False, length=2, max_tokens=2, n=1, salt=None, tail=0, text=0)), ("step", {}),
           ("add", dict(eos=False, length=1, max_tokens=2, n=1, salt=None, tail=0, text=0)), ("step", {}),
           ("plan_raises", dict(alone=False, at=3, data=_Draws(), method="allocate_slots"))])
    assert machine.runner.reads > 0
