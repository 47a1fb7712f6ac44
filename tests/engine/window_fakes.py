"""A model-free stand-in for the ranks of a hybrid KV layout (``engine/window_kv.py``): it mirrors the
block tables and the window tables from the scheduler's diffs and keeps the 'KV' each step writes, per
page and slot, for the full layers (the block table) and each window group (its table). Before a
step's tokens are written it reads, for each request, every position its window layers see (positions
> p - window of its first query p) through its tables, asserting they hold that position's content:
so a window page that was released, evicted or handed out too early, or a hit that reuses a page
holding something else, fails here."""

from __future__ import annotations

from engine.kv_layout import KVLayout
from engine.messages import ModelRunnerOutput, SchedulerOutput
from tests.engine.fakes import VOCAB, StepFault


def content(tokens: list[int], pos: int) -> tuple:
    """What a position's KV stands for: the position and the tokens up to it (the last 16)."""
    return pos, tuple(tokens[max(0, pos - 15):pos + 1])


class WindowRunner:
    def __init__(self, block_size: int, layout: KVLayout) -> None:
        self.bs, self.layout = block_size, layout
        self.groups = layout.num_window_groups
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.windows: dict[str, list[list[int]]] = {}
        self.computed: dict[str, int] = {}
        self.kv: dict[tuple[int, int, int], tuple] = {}  # (table 0 / group + 1, page, slot) -> content
        self.reads = 0  # window positions read and found right

    def execute_model(self, so: SchedulerOutput, fail: str | None = None) -> ModelRunnerOutput:
        if fail == "before":
            raise StepFault("the step failed before it reached the ranks")
        for req_id in so.finished_req_ids:
            for state in (self.tokens, self.blocks, self.windows, self.computed):
                state.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.tokens, f"{new.req_id} sent as new twice"
            assert len(new.window_block_ids) == self.groups
            assert all(len(ids) == len(new.block_ids) for ids in new.window_block_ids)
            self.tokens[new.req_id] = list(new.token_ids)
            self.blocks[new.req_id] = list(new.block_ids)
            self.windows[new.req_id] = [list(ids) for ids in new.window_block_ids]
            self.computed[new.req_id] = new.num_computed_tokens
        for diff in so.scheduled_cached_reqs:
            assert len(diff.new_window_block_ids) == self.groups
            for ids, new_ids in zip(self.windows[diff.req_id], diff.new_window_block_ids):
                assert len(new_ids) == len(diff.new_block_ids) and 0 not in new_ids  # new blocks have pages
                ids.extend(new_ids)
            self.tokens[diff.req_id].extend(diff.new_token_ids)
            self.blocks[diff.req_id].extend(diff.new_block_ids)
            self.computed[diff.req_id] = diff.num_computed_tokens
        if fail == "after_update":
            raise StepFault("the step failed after the diffs were applied")
        bs, window = self.bs, self.layout.window
        for req_id, n in so.num_scheduled_tokens.items():
            start, tokens = self.computed[req_id], self.tokens[req_id]
            tables = [self.blocks[req_id]] + self.windows[req_id]
            for pos in range(max(0, start - window + 1), start):  # what the first query's window sees
                for t, table in enumerate(tables):
                    assert table[pos // bs] != 0, (req_id, pos, t)
                    assert self.kv.get((t, table[pos // bs], pos % bs)) == content(tokens, pos), (req_id, pos, t)
                    self.reads += 1
            for pos in range(start, start + n):
                for t, table in enumerate(tables):
                    assert table[pos // bs] != 0, (req_id, pos, t)
                    self.kv[t, table[pos // bs], pos % bs] = content(tokens, pos)
        if fail == "after_forward":
            raise StepFault("the step failed after the forward pass")
        req_ids, sampled = [], []
        for req_id, n in so.num_scheduled_tokens.items():
            self.computed[req_id] += n
            req_ids.append(req_id)
            tokens = self.tokens[req_id]
            done = self.computed[req_id] == len(tokens)
            sampled.append([(sum(tokens) * 31 + len(tokens)) % VOCAB] if done else [])
        return ModelRunnerOutput(req_ids, sampled, [None] * len(req_ids))

    def check_mirror(self, sched) -> None:
        """The window ids the ranks hold for each request's blocks from its window on are the pages
        attached to those blocks (below it they may be stale: the kernels skip them)."""
        kv = sched.kv
        for request in sched.running:
            rid = request.request_id
            if not request.num_tokens_sent:
                continue
            table = kv.req_to_blocks[rid]
            for i in range(kv._win_start[rid], request.num_blocks_sent):
                assert [ids[i] for ids in self.windows[rid]] == [p.block_id for p in table[i].window_pages], (rid, i)


def window_pool_check(kv) -> None:
    """The pool's ref counts with window pages: a table block's ref count is the tables holding it,
    a page's is 1 while held; the window invariants (``check_window_invariants``)."""
    pool = kv.block_pool
    holders: dict[int, int] = {}
    for table in kv.req_to_blocks.values():
        for block in table:
            holders[block.block_id] = holders.get(block.block_id, 0) + 1
    for block in pool.blocks[1:]:
        if block.owner is not None and block.owner.holds:
            assert block.ref_cnt == 1 and block.block_id not in holders, block
        else:
            assert block.ref_cnt == holders.get(block.block_id, 0), block
    kv.check_window_invariants()
