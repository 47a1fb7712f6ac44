"""Property test: the scheduler's random add / step / fail / abort sequences with a host tier, against
a runner that copies its 'KV' between the pool and a tier of its own; after every rule the pool
invariants hold, every cached block and every tier entry holds the tokens it is indexed by (once its
copy has run), and pins belong to copies in flight."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import initialize, invariant

from engine.scheduler import Scheduler
from tests.engine.fakes import check_ref_counts
from tests.engine.test_host_tier import TierRunner
from tests.engine.test_scheduler_properties import BLOCK_SIZE, MAX_MODEL_LEN, SchedulerMachine


class TierMachine(SchedulerMachine):
    @initialize(num_blocks=st.integers(11, 20), budget=st.integers(4, 32), max_num_seqs=st.integers(1, 5),
                num_host=st.integers(1, 10))
    def setup(self, num_blocks, budget, max_num_seqs, num_host):
        self.sched = Scheduler(num_kv_blocks=num_blocks, block_size=BLOCK_SIZE, enable_prefix_caching=True,
                               max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                               max_model_len=MAX_MODEL_LEN, num_host_kv_blocks=num_host)
        self.runner = TierRunner(BLOCK_SIZE)
        self.next_id = 0
        self.budget = budget

    @invariant()
    def pool_is_consistent(self):
        kv = self.sched.kv
        pool = kv.block_pool
        check_ref_counts(kv)
        pending = {c.block.block_id for c in kv._pending_copies if not c.offload}
        for block_hash, blocks in pool.cached.items():
            for block_id, block in blocks.items():
                assert block.block_hash == block_hash
                if block_id in pending:
                    continue  # its restore goes with the next step that runs
                written = self.runner.kv.get(block_id, {})
                assert tuple(written.get(i) for i in range(BLOCK_SIZE)) == block.token_ids, block
        assert sum(len(b) for b in pool.cached.values()) == sum(b.block_hash is not None for b in pool.blocks)

    @invariant()
    def tier_holds_what_it_indexes(self):
        kv = self.sched.kv
        tier = kv.host_tier
        pending = {c.entry.slot for c in kv._pending_copies if c.offload}
        slots = [e.slot for e in tier.resident()]
        assert len(slots) == len(set(slots)) == tier.num_resident <= tier.num_slots
        for entry in tier.resident():
            if entry.slot not in pending:
                assert tuple(self.runner.tier[entry.slot].get(i) for i in range(BLOCK_SIZE)) == entry.token_ids
        in_flight = {c.entry.slot for c in kv._pending_copies + kv._sent_copies}
        assert {s for s in range(tier.num_slots) if tier.is_pinned(s)} <= in_flight
        stats = kv.tier_stats
        assert 0 <= stats.hits <= stats.queries and stats.offloaded >= 0


TierMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestTierProperties = TierMachine.TestCase
