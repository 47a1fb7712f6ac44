"""Property test: the scheduler machine of test_scheduler_properties, plus plans that raise at a
random allocation or prefix lookup (after hits, forks, preemptions, evictions): each leaves the
scheduler, the tables and the pool exactly as they were, and every invariant and the final drain
still hold (so the undone plans leak nothing and serve no unwritten KV)."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import rule

from tests.engine.fakes import check_ref_counts
from tests.engine.test_scheduler_properties import SchedulerMachine


class PlanFault(Exception):
    pass


def state(sched) -> tuple:
    kv = sched.kv
    pool = kv.block_pool
    check_ref_counts(kv)
    return (
        [r.request_id for r in sched.running], [r.request_id for r in sched.waiting],
        {i: (r.status, r.num_computed_tokens, r.num_tokens_sent, r.num_blocks_sent, r.num_cached_tokens,
             r.num_preemptions, r.fork_source and r.fork_source.request_id) for i, r in sched.requests.items()},
        set(sched._dropped_ids),
        (sched.stats.num_preemptions, sched.stats.num_prompt_tokens, sched.stats.prefix_cache_queries,
         sched.stats.prefix_cache_hits, sched.stats.queue_time.count, sched.stats.kv_peak_blocks),
        {i: [b.block_id for b in t] for i, t in kv.req_to_blocks.items()}, dict(kv._num_cached_blocks),
        pool.num_free_blocks, sorted((h, i) for h, blocks in pool.cached.items() for i in blocks), pool.num_evictions,
    )


class PlanUndoMachine(SchedulerMachine):
    @rule(at=st.integers(1, 6), method=st.sampled_from(["allocate_slots", "get_computed_blocks"]),
          alone=st.booleans(), data=st.data())
    def plan_raises(self, at, method, alone, data):
        sched = self.sched
        only = data.draw(st.sampled_from(sorted(sched.requests))) if alone and sched.requests else None
        sched.kv.begin_step()  # what the plan starts with (the last step ran)
        before = state(sched)
        real, calls = getattr(sched.kv, method), []

        def fault(*args, **kwargs):
            calls.append(1)
            if len(calls) == at:
                raise PlanFault
            return real(*args, **kwargs)

        setattr(sched.kv, method, fault)
        try:
            so = sched.schedule(only=only)
        except PlanFault:
            so = None
        finally:
            del sched.kv.__dict__[method]
        if so is None:
            assert state(sched) == before
        elif not so.is_empty:  # fewer calls than ``at``: the plan stands, and runs
            sched.update_from_output(so, self.runner.execute_model(so))


PlanUndoMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestPlanUndoProperties = PlanUndoMachine.TestCase
