"""Which window pages each request holds, with a hybrid KV layout (``engine.kv_layout``): the part of
``KVCacheManager`` (its base) that lets window layers release their pages behind the window.

A request holds the window pages of a suffix of its block table: blocks ``_win_start[id]`` onwards
(each of them has G pages attached, ``engine/window_pages.py``). A newly allocated block comes with G
pages (from the same pool) held by its request; blocks joined from a prefix hit or a fork are held
from ``first_needed_block(start)`` on, the earlier ones not at all (their window ids are 0). At the
start of each plan, before anything is scheduled, every running request drops its holds below
``first_needed_block(num_computed_tokens)`` (``release_behind_windows``): steps are synchronous and a
rolled-back step returns ``num_computed_tokens`` to that value, so the request never reads them
again. A block whose last hold goes keeps its pages in the free queue while it is cached (a later
prefix hit takes them back), else frees them.

A prefix hit or a fork is cut back to the longest chain k whose blocks [first_needed_block(k * bs), k)
all still have their pages attached (``_window_chain``), so a hit never yields a window id of 0 where
the request will read.

Invariants (``check_window_invariants``): every running request's held blocks have pages attached;
each block's ``holds`` is the number of requests holding it; the pool's own (``WindowPages``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.kv_layout import KVLayout

if TYPE_CHECKING:
    from engine.block_pool import BlockPool, KVCacheBlock
    from engine.request import Request


class WindowHolds:
    layout: KVLayout
    block_size: int
    block_pool: BlockPool
    req_to_blocks: dict[str, list[KVCacheBlock]]

    def _init_windows(self, layout: KVLayout | None, num_layers_fallback: int = 1) -> None:
        self.layout = layout if layout is not None else KVLayout.plain(num_layers_fallback)
        self.num_window_groups = self.layout.num_window_groups
        self._win_start: dict[str, int] = {}  # request id -> first block whose pages it holds

    def first_needed(self, num_computed: int) -> int:
        return self.layout.first_needed_block(num_computed, self.block_size)

    def _window_chain(self, blocks: list[KVCacheBlock]) -> int:
        """The longest k <= len(blocks) for which blocks [first_needed(k * bs), k) all have pages."""
        k = len(blocks)
        while k:
            low = self.first_needed(k * self.block_size)
            missing = next((i for i in range(k - 1, low - 1, -1) if blocks[i].window_pages is None), None)
            if missing is None:
                break
            k = missing  # every longer chain up to here reads block ``missing``
        return k

    def release_behind_windows(self, running: list[Request], waiting=()) -> None:
        """Each running request drops its holds on the blocks below its window (see the docstring); a
        request that n > 1 siblings waiting in ``waiting`` will fork keeps the blocks their fork reads."""
        if not self.num_window_groups:
            return
        sources = {id(r.fork_source) for r in waiting if r.fork_source is not None}
        release = self.block_pool.release
        for request in running:
            table = self.req_to_blocks.get(request.request_id)
            if not table:
                continue
            start = self._win_start[request.request_id]
            end = min(self.first_needed(request.num_computed_tokens), len(table))
            if (sources and id(request) in sources and request.num_computed_tokens <= request.num_prompt_tokens):
                # a fork takes (prompt - 1) // bs blocks; kept only until the source decodes past its
                # prompt (a sibling that could not start by then recomputes what was released): the
                # holds stay within ``max_pages_per_sequence``, so one sequence alone always fits
                end = min(end, self.first_needed((request.num_prompt_tokens - 1) // self.block_size * self.block_size))
            for i in range(start, end):  # advanced block by block: an interruption leaves it true
                release(table[i])
                self._win_start[request.request_id] = i + 1

    def _drop_holds(self, request_id: str, table: list[KVCacheBlock]) -> None:
        start = self._win_start.pop(request_id, len(table))
        release = self.block_pool.release
        for block in reversed(table[start:]):
            release(block)

    def window_block_ids(self, request_id: str, first: int = 0) -> list[list[int]]:
        """Per window group, the page ids of the request's blocks ``first`` onwards (0 where it holds
        none): ``NewRequestData.window_block_ids`` / ``CachedRequestData.new_window_block_ids``."""
        if not self.num_window_groups:
            return []
        table = self.req_to_blocks.get(request_id, [])
        start = self._win_start.get(request_id, len(table))
        return [[block.window_pages[g].block_id if i >= start else 0 for i, block in enumerate(table[first:], first)]
                for g in range(self.num_window_groups)]

    def pages_held(self, request_id: str) -> int:
        """Pages ``request_id`` holds: its table's blocks and the window pages it holds."""
        table = self.req_to_blocks.get(request_id, ())
        return len(table) + self.num_window_groups * (len(table) - self._win_start.get(request_id, len(table)))

    def resync_windows(self) -> list[str]:
        """Recompute every block's holds from the tables and ``_win_start`` (a plan being undone gave
        blocks and pages back in no order window pages know of). A request one of whose held blocks
        lost its pages is returned and holds nothing now: the caller preempts it for recompute."""
        expected: dict[int, int] = {}
        lost = []
        for request_id, table in self.req_to_blocks.items():
            held = table[self._win_start.setdefault(request_id, len(table)):]
            if any(block.window_pages is None for block in held):
                lost.append(request_id)
                self._win_start[request_id] = len(table)
                continue
            for block in held:
                expected[block.block_id] = expected.get(block.block_id, 0) + 1
        for block in self.block_pool.blocks[1:]:
            if block.window_pages is not None:
                self.block_pool.set_holds(block, expected.get(block.block_id, 0))
        return lost

    def check_window_invariants(self) -> None:
        """Assert the invariants of the module docstring and the pool's (for tests: walks the pool)."""
        pool = self.block_pool
        if not self.num_window_groups:
            assert not self._win_start and not pool.num_held_pages
            assert all(b.window_pages is None and b.owner is None for b in pool.blocks)
            return
        assert set(self._win_start) == set(self.req_to_blocks)
        holds: dict[int, int] = {}
        for request_id, table in self.req_to_blocks.items():
            assert 0 <= self._win_start[request_id] <= len(table)
            for block in table[self._win_start[request_id]:]:
                assert block.window_pages is not None, (request_id, block)
                holds[block.block_id] = holds.get(block.block_id, 0) + 1
        for block in pool.blocks[1:]:
            assert block.holds == holds.get(block.block_id, 0), block
        pool.check_window_invariants(self.num_window_groups)


def max_pages_per_sequence(layout: KVLayout, block_size: int, max_len: int, chunk: int) -> int:
    """The most pages one sequence of ``max_len`` tokens holds at once: its blocks, and G window pages
    for each block that its window before a prefill chunk of ``chunk`` tokens and the chunk span
    (the positions s - window + 1 .. s + chunk - 1, at any alignment), at most every block."""
    num_blocks = -(-max_len // block_size)
    if not layout.hybrid:
        return num_blocks
    # a source keeping the pages its n > 1 siblings fork holds one more block with a chunk <= block_size
    # (``release_behind_windows``): as if the chunk were one token longer than a block
    span = (layout.window + max(chunk, block_size + 1) - 1 + 2 * block_size - 2) // block_size
    return num_blocks + layout.num_window_groups * min(num_blocks, span)


def check_pool_fits(num_blocks: int, block_size: int, max_len: int, layout: KVLayout, chunk: int) -> None:
    """Raise ValueError when a pool of ``num_blocks`` (the null block among them) cannot hold one
    sequence of ``max_len`` tokens (``max_pages_per_sequence``)."""
    need = max_pages_per_sequence(layout, block_size, max_len, chunk)
    if need <= num_blocks - 1:
        return
    if not layout.hybrid:
        raise ValueError(
            f"the KV pool ({num_blocks - 1} usable blocks of {block_size} tokens = "
            f"{(num_blocks - 1) * block_size} tokens) cannot hold one sequence of max_model_len="
            f"{max_len}; give more KV memory or blocks, or set max_model_len <= "
            f"{(num_blocks - 1) * block_size}"
        )
    window_pages = need - -(-max_len // block_size)
    raise ValueError(
        f"the KV pool ({num_blocks - 1} usable pages of {block_size} tokens) cannot hold one sequence of "
        f"max_model_len={max_len} with the hybrid KV layout ({need} pages: {need - window_pages} blocks and "
        f"{window_pages} window pages of {layout.num_window_groups} window group(s) for a {layout.window}-token "
        f"window and {chunk}-token prefill chunks); give more KV memory or blocks, or lower max_model_len or "
        f"max_num_batched_tokens, or set disable_hybrid_kv_cache_manager"
    )
