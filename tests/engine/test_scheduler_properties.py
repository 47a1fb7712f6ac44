"""Property test: random add / step / abort / finish sequences through the scheduler, with the pool
invariants checked after every rule."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pytest

from engine.request import RequestStatus
from engine.scheduler import Scheduler
from tests.engine.fakes import FakeRunner, StepFault, check_ref_counts, make_request

BLOCK_SIZE = 4
MAX_MODEL_LEN = 40
# prompts are cut from a few shared texts so that prefixes repeat and the cache gets hits
TEXTS = [[1 + (i * 7) % 40 for i in range(40)], [1 + (i * 3) % 40 for i in range(40)], list(range(1, 41))]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(caching=st.booleans(), num_blocks=st.integers(11, 24), budget=st.integers(4, 32),
                max_num_seqs=st.integers(1, 5))
    def setup(self, caching, num_blocks, budget, max_num_seqs):
        self.sched = Scheduler(num_kv_blocks=num_blocks, block_size=BLOCK_SIZE, enable_prefix_caching=caching,
                               max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                               max_model_len=MAX_MODEL_LEN)
        self.runner = FakeRunner(BLOCK_SIZE)
        self.next_id = 0
        self.budget = budget

    @rule(text=st.integers(0, len(TEXTS) - 1), length=st.integers(1, MAX_MODEL_LEN), tail=st.integers(0, 3),
          max_tokens=st.integers(1, 12), n=st.integers(1, 3), salt=st.sampled_from([None, "t1"]),
          eos=st.booleans())
    def add(self, text, length, tail, max_tokens, n, salt, eos):
        prompt = (TEXTS[text][:length] + [41 + tail])[:MAX_MODEL_LEN]
        first = None
        for i in range(n):
            request = make_request(f"r{self.next_id}#{i}", prompt, max_tokens=max_tokens, block_size=BLOCK_SIZE,
                                   cache_salt=salt, fork_source=first, ignore_eos=not eos)
            first = first or request
            self.sched.add_request(request)
        self.next_id += 1

    @rule()
    def step(self):
        so = self.sched.schedule()
        assert so.total_num_scheduled_tokens <= self.budget
        assert sum(so.num_scheduled_tokens.values()) == so.total_num_scheduled_tokens
        assert len(self.sched.running) <= self.sched.max_num_seqs
        if so.is_empty:
            return
        out = self.runner.execute_model(so)
        self.sched.update_from_output(so, out)

    @rule(where=st.sampled_from(["before", "after_update", "after_forward"]))
    def failed_step(self, where):
        """A step raises: the scheduler rolls it back as if it had never been planned."""
        so = self.sched.schedule()
        if so.is_empty:
            return
        with pytest.raises(StepFault):
            self.runner.execute_model(so, fail=where)
        self.sched.rollback(so)

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data(), fail=st.booleans())
    def step_alone(self, data, fail):
        """A step planned for one request only (how a failed step's culprit is found)."""
        request_id = data.draw(st.sampled_from(sorted(self.sched.requests)))
        running_before = {r.request_id for r in self.sched.running}
        so = self.sched.schedule(only=request_id)
        assert set(so.num_scheduled_tokens) <= {request_id}
        assert {r.request_id for r in self.sched.running} <= running_before | {request_id}
        if so.is_empty:
            return
        if fail:
            with pytest.raises(StepFault):
                self.runner.execute_model(so, fail="after_forward")
            self.sched.rollback(so)
        else:
            self.sched.update_from_output(so, self.runner.execute_model(so))

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.sched.requests)))
        self.sched.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)

    @precondition(lambda self: self.sched.running)
    @rule(data=st.data())
    def finish_by_stop_string(self, data):
        request_id = data.draw(st.sampled_from(sorted(r.request_id for r in self.sched.running)))
        self.sched.finish_requests([request_id], RequestStatus.FINISHED_STOPPED)

    @invariant()
    def pool_is_consistent(self):
        kv = self.sched.kv
        pool = kv.block_pool
        check_ref_counts(kv)
        in_map = 0
        for block_hash, blocks in pool.cached.items():
            assert blocks
            for block_id, block in blocks.items():
                in_map += 1
                assert block.block_id == block_id and block.block_hash == block_hash
                assert block.token_ids is not None
                # a cached block holds the KV of its tokens: the step that was to write it has run
                written = self.runner.kv.get(block.block_id, {})
                assert tuple(written.get(i) for i in range(BLOCK_SIZE)) == block.token_ids, block
        # every block carrying a hash is findable under it (duplicates included)
        assert in_map == pool.num_cached_blocks == sum(b.block_hash is not None for b in pool.blocks)
        assert set(kv.req_to_blocks) <= set(self.sched.requests)

    @invariant()
    def tables_cover_computed_tokens_and_match_hashes(self):
        kv = self.sched.kv
        for request in self.sched.running:
            table = kv.req_to_blocks[request.request_id]
            assert len(table) * BLOCK_SIZE >= request.num_computed_tokens
            for i, block in enumerate(table[: request.num_computed_tokens // BLOCK_SIZE]):
                if block.block_hash is not None and kv.enable_caching:
                    assert block.block_hash == request.block_hashes[i]
        for request in self.sched.waiting:
            assert request.request_id not in kv.req_to_blocks
            assert request.num_computed_tokens == 0

    @invariant()
    def workers_mirror_the_scheduler(self):
        for request in self.sched.running:
            if request.num_tokens_sent:
                rid = request.request_id
                assert self.runner.tokens[rid] == request.all_token_ids[: request.num_tokens_sent]
                assert self.runner.blocks[rid] == self.sched.kv.get_block_ids(rid)[: request.num_blocks_sent]

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        # every request must finish: the queue may be long (one sequence, a 4-token budget), but some
        # request has to finish within a bounded number of steps, or the scheduler is livelocked
        left, idle = self.sched.num_unfinished_requests, 0
        while left and idle < 200:
            self.step()
            now = self.sched.num_unfinished_requests
            idle = 0 if now < left else idle + 1
            left = now
        assert not self.sched.has_unfinished_requests(), "requests never finished"
        pool = self.sched.kv.block_pool
        assert pool.num_free_blocks == pool.num_usable_blocks, "leaked blocks"
        assert not self.sched.kv.req_to_blocks


SchedulerMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestSchedulerProperties = SchedulerMachine.TestCase
