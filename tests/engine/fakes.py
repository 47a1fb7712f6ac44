"""A model-free stand-in for the ranks, for scheduler tests: it mirrors worker state from the
scheduler's diffs (checking they are consistent) and 'samples' a deterministic token."""

from __future__ import annotations

import collections

from engine.messages import ModelRunnerOutput, SchedulerOutput
from engine.request import Request
from engine.sampling_params import SamplingParams

VOCAB = 50
EOS = 0


def make_request(request_id: str, prompt: list[int], *, max_tokens: int = 8, block_size: int = 4,
                 cache_salt: str | None = None, fork_source: Request | None = None,
                 ignore_eos: bool = True) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    return Request(request_id, prompt, params, eos_token_ids=frozenset({EOS}), block_size=block_size,
                   max_tokens=max_tokens, cache_salt=cache_salt, fork_source=fork_source)


class StepFault(RuntimeError):
    """The failure a FakeRunner was told to raise."""


class FakeRunner:
    """Holds per-request token ids and block ids exactly as a worker would. With ``block_size`` it
    also keeps the 'KV' it writes: block id -> {slot: token id}, each step's tokens stored before
    anything is sampled."""

    def __init__(self, block_size: int | None = None) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.block_size = block_size
        self.kv: dict[int, dict[int, int]] = {}

    def execute_model(self, so: SchedulerOutput, fail: str | None = None) -> ModelRunnerOutput:
        """``fail``: raise StepFault "before" the step reaches the ranks, "after_update" (the diffs
        applied, nothing computed) or "after_forward" (the KV written, nothing sampled)."""
        if fail == "before":
            raise StepFault("the step failed before it reached the ranks")
        for req_id in so.finished_req_ids:
            self.tokens.pop(req_id, None)
            self.blocks.pop(req_id, None)
            self.computed.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.tokens, f"{new.req_id} sent as new twice"
            self.tokens[new.req_id] = list(new.token_ids)
            self.blocks[new.req_id] = list(new.block_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        for diff in so.scheduled_cached_reqs:
            assert self.computed[diff.req_id] <= diff.num_computed_tokens
            self.tokens[diff.req_id].extend(diff.new_token_ids)
            self.blocks[diff.req_id].extend(diff.new_block_ids)
            self.computed[diff.req_id] = diff.num_computed_tokens
        if fail == "after_update":
            raise StepFault("the step failed after the diffs were applied")
        if self.block_size is not None:
            bs = self.block_size
            for req_id, n in so.num_scheduled_tokens.items():
                start = self.computed[req_id]
                for pos in range(start, start + n):
                    self.kv.setdefault(self.blocks[req_id][pos // bs], {})[pos % bs] = self.tokens[req_id][pos]
        if fail == "after_forward":
            raise StepFault("the step failed after the forward pass")
        req_ids, sampled = [], []
        for req_id, n in so.num_scheduled_tokens.items():
            self.computed[req_id] += n
            req_ids.append(req_id)
            tokens = self.tokens[req_id]
            assert self.computed[req_id] <= len(tokens)
            done = self.computed[req_id] == len(tokens)
            sampled.append([(sum(tokens) * 31 + len(tokens)) % VOCAB] if done else [])
        return ModelRunnerOutput(req_ids, sampled, [None] * len(req_ids))


def check_ref_counts(kv) -> None:
    """Pool invariants every state must keep: each block's ref count is the number of block tables
    holding it, the free queue holds each free block once and nothing else, the null block is never
    held nor free."""
    pool = kv.block_pool
    holders = collections.Counter(b.block_id for t in kv.req_to_blocks.values() for b in t)
    in_queue = [b.block_id for b in pool.free_queue]
    assert len(in_queue) == len(set(in_queue)) == pool.num_free_blocks
    assert 0 not in in_queue and holders[0] == 0
    free = set(in_queue)
    assert [b.block_id for b in pool.blocks] == list(range(len(pool.blocks)))  # made: a prefix of the ids
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders[block.block_id], block
        assert (block.ref_cnt == 0) == (block.block_id in free), block
    # never handed out: free, after the blank blocks (freed without a hash) and before the cached ones
    fresh = range(len(pool.blocks), pool.num_blocks)
    blank = [b.block_id for b in pool.free_queue.blank_blocks()]
    assert all(pool.blocks[i].block_hash is None and pool.blocks[i].owner is None for i in blank)
    assert in_queue[:len(blank)] == blank
    assert len(fresh) == pool.num_fresh_blocks and in_queue[len(blank):len(blank) + len(fresh)] == list(fresh)
    assert not any(holders[i] for i in fresh)
