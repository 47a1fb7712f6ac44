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
