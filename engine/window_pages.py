"""The window pages of a hybrid KV layout (``engine.kv_layout``, G window groups): ordinary blocks of
the pool that hold a block's KV for the window groups' layers. A table block may have G pages attached
(``window_pages``; each page's ``owner`` is that block) and ``holds`` counts the requests holding them
(``KVCacheManager`` decides who holds what). Invariants (``check_window_invariants``):
- an attached set has G pages, each owned by the block, carrying no hash, and in no set of another;
- holds > 0  =>  the block has pages attached, each out of the free queue with ref_cnt 1;
- holds == 0 with pages attached  =>  the block is cached and its pages are in the free queue (they
  follow the block in the prefix cache: a later hit takes them back out); while a step is planned an
  uncached block's free pages also stay attached (``deferred_detach``), detached when the plan ends;
- a free page may be handed out: that detaches its owner's whole set (the others stay free); a cached
  block evicted or uncached while no one holds its pages detaches them (they stay free).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.block_pool import KVCacheBlock

FREE, USED = b"fu"  # a block's state in ``BlockPool.states`` (and b"c" cached, b"s" shared)


class WindowPages:
    """The window-page part of ``engine.block_pool.BlockPool`` (its base: it uses the pool's free queue,
    states and blocks)."""

    num_held_pages = 0  # window pages held by requests
    # while a step is planned: blocks whose last hold went without a hash, their pages kept attached (and
    # free) until the plan ends, so that a plan undone gives a request it preempted its own pages back
    deferred_detach: list[KVCacheBlock] | None = None

    def begin_deferring(self) -> None:
        self.deferred_detach = []

    def end_deferring(self) -> None:
        """Detach what the plan kept attached and still nobody holds (a page handed out meanwhile
        has detached its set already)."""
        deferred, self.deferred_detach = self.deferred_detach or [], None
        for block in deferred:
            if block.window_pages is not None and not block.holds and block.block_hash is None:
                self.detach(block)

    def _detach_unhashed(self, block: KVCacheBlock) -> None:
        if self.deferred_detach is not None:
            self.deferred_detach.append(block)
        else:
            self.detach(block)

    def attach(self, block: KVCacheBlock, pages: list[KVCacheBlock]) -> None:
        """Give a newly handed-out ``block`` its window pages (handed out with it), held once."""
        block.window_pages = pages
        for page in pages:
            page.owner = block
        block.holds = 1
        self.num_held_pages += len(pages)

    def detach(self, block: KVCacheBlock) -> None:
        """``block`` loses its attached pages (their ref counts stay; a free one, blank now, moves to the
        head of the free queue)."""
        for page in block.window_pages:
            page.owner = None
            if not page.ref_cnt:
                self.free_queue.requeue(page)
        block.window_pages = None

    def hold(self, block: KVCacheBlock) -> None:
        """One more request holds ``block``'s attached pages (taken out of the free queue by the first)."""
        if not block.holds:
            states = self.states
            for page in block.window_pages:
                self.free_queue.remove(page)
                page.ref_cnt = 1
                states[page.block_id] = USED
            self.num_held_pages += len(block.window_pages)
        block.holds += 1

    def release(self, block: KVCacheBlock) -> None:
        """A request drops its hold on ``block``'s pages. The last one: they follow a cached block into
        the free queue (still attached), else they are detached and freed."""
        if block.holds <= 0:
            raise RuntimeError(f"release of window pages nobody holds: {block}")
        block.holds -= 1
        if block.holds:
            return
        pages = block.window_pages
        self.num_held_pages -= len(pages)
        if block.block_hash is None:
            self._detach_unhashed(block)
        states = self.states
        for page in pages:
            page.ref_cnt = 0
            self.free_queue.append(page)
            states[page.block_id] = FREE

    def set_holds(self, block: KVCacheBlock, holds: int) -> None:
        """Make ``block``'s holds ``holds`` whatever the state its pages are in (a plan being undone)."""
        pages = block.window_pages
        if block.holds:
            self.num_held_pages -= len(pages)
        block.holds = holds
        if holds:
            self.num_held_pages += len(pages)
        elif block.block_hash is None:
            self._detach_unhashed(block)
        states = self.states
        for page in pages:
            if holds and not page.ref_cnt:
                self.free_queue.remove(page)
                page.ref_cnt = 1
                states[page.block_id] = USED
            elif not holds and page.ref_cnt:
                page.ref_cnt = 0
                self.free_queue.append(page)
                states[page.block_id] = FREE

    def check_window_invariants(self, num_groups: int) -> None:
        """Assert the window-page invariants of the module docstring (for tests; walks the pool)."""
        free = {b.block_id for b in self.free_queue}
        held = 0
        owners: dict[int, int] = {}
        for block in self.blocks[1:]:
            pages = block.window_pages
            if pages is None:
                assert not block.holds, block
                continue
            assert len(pages) == num_groups, block
            for page in pages:
                assert page.owner is block and page.block_hash is None and page.window_pages is None, (block, page)
                assert owners.setdefault(page.block_id, block.block_id) == block.block_id, page
                assert (page.block_id not in free) == bool(block.holds) == (page.ref_cnt == 1), (block, page)
            if block.holds:
                held += num_groups
            else:
                assert block.block_hash is not None, block
        for block in self.blocks[1:]:
            assert block.owner is None or block.block_id in owners, block
        assert held == self.num_held_pages
        assert self.num_free_blocks == len(free)
        assert self.num_used_blocks + self.num_free_blocks == self.num_usable_blocks
