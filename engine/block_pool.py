"""The KV block pool: reference counts, the LRU free queue, and blocks made only when first used.

Invariants (checked by the property tests):
- block 0 is the null block: never handed out, never freed, never in the free queue;
- for every other block: ref_cnt == 0  <=>  the block is in the free queue;
- a block in the hash map has that hash, and carries the token ids it was cached with;
- every block that carries a hash is in the map under it (duplicates too: hash -> {block id: block});
- the blocks made so far are exactly ids 0 .. k-1, listed in ``BlockPool.blocks`` by id; ids k .. N-1
  are fresh: never handed out, so free, uncached, and with no object yet.

Window pages of a hybrid KV layout: ``engine/window_pages.py`` (``WindowPages``, a base of BlockPool).

A freed block keeps its hash until it is handed out again: that is the prefix cache. The free queue
is ordered for hand-out: first the blank blocks (freed without a hash: nothing in them can be hit),
the most recently freed first; then the fresh ids, in id order; then the cached blocks, least
recently freed first (the eviction order)::

    head <-> b5 <-> b2 <-> [fresh k .. N-1] <-> b7 <-> b3 <-> b9 <-> tail
             (blank, latest first)               (cached, LRU first)

get_new_blocks takes from the head (fresh ids made into blocks as they are handed out); free pushes
a blank block at the head and appends a cached one at the tail. This is the order of a queue that
starts as 1 .. N-1 with every block made and blank. Reusing blank blocks before fresh ones keeps a
pool's touched memory at what runs at once (a pool of millions of blocks costs nothing at start and
only what it has used since; on CPU, the pages of the KV pool are faulted in, and zeroed, on first
touch) and hands out the block most likely still in the caches; it never costs a prefix hit, since a
blank block holds none, and fresh ids are still taken before any cached block is evicted. A block's
place is chosen when it is freed and changes with its state while it is free: a free block given a
hash moves to the cached blocks' tail; one that loses its hash (or a window page its owner) moves to
the head, blank.

Two summaries are kept as the pool changes, so that readers on other threads (the router's report,
the dashboard) copy them under the engine's lock instead of walking the pool: ``recent`` (the
routing report's hashes by recency of use, and the log of its changes: ``engine/prefix_report.py``)
and ``states`` (one byte per block id: ``f`` free, ``c`` cached, ``u`` used by one request, ``s``
shared; it covers the blocks made so far, fresh ids being free).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import islice

from engine.block_hash import BlockHash
from engine.free_queue import FreeKVCacheBlockQueue, FreshBlock, KVCacheBlock  # noqa: F401 (imported from here)
from engine.prefix_report import REPORT_LIMIT, RecentHashes
from engine.window_pages import FREE, USED, WindowPages

CACHED, SHARED = b"cs"  # a block's state in ``BlockPool.states``


class BlockPool(WindowPages):
    """Hands out blocks, takes them back, and keeps the hash -> block map of the prefix cache."""

    def __init__(self, num_blocks: int, enable_caching: bool, report_limit: int = REPORT_LIMIT) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.null_block = KVCacheBlock(0)
        self.null_block.is_null = True
        # the blocks made so far, by id (the null block, then each block as it is first handed out)
        self.blocks: list[KVCacheBlock] = [self.null_block]
        self.free_queue = FreeKVCacheBlockQueue(self.blocks, num_blocks)
        # hash -> the blocks that hold it: a block computed again (a prompt exactly k blocks long
        # recomputes its last block) is kept as a duplicate, findable once the first copy is evicted
        self.cached: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.num_cached_blocks = 0
        self.num_evictions = 0
        # called with a cached block about to be evicted (hash and token ids still set): the host
        # tier's chance to copy it out
        self.on_evict: Callable[[KVCacheBlock], None] | None = None
        # whether a hash is held outside the pool (the host tier): it then stays in ``recent``
        self.held_elsewhere: Callable[[BlockHash], bool] | None = None
        self.recent = RecentHashes(report_limit)
        self.states = bytearray(b"u")  # by block id, of the made blocks (the null block's means nothing)
        self.num_held_pages = 0  # window pages held by requests (hybrid layout: ``WindowPages``)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def num_blocks_made(self) -> int:
        """Block objects made so far, the null block aside: each is made on its id's first use, so the
        pool's memory grows until every id was used once (its first fill), then stays."""
        return len(self.blocks) - 1

    @property
    def num_fresh_blocks(self) -> int:
        """Free blocks never handed out (no object made yet): ids len(blocks) .. num_blocks-1."""
        return self.free_queue.num_fresh_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by some request (cached-but-free blocks count as free)."""
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Share of usable blocks referenced by some request."""
        return self.num_used_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> KVCacheBlock | None:
        """A block holding ``block_hash`` with these tokens: one with window pages attached first (a
        hybrid layout: a hit can use them), then one in use (no eviction order to disturb), else any."""
        blocks = self.cached.get(block_hash)
        if not blocks:
            return None
        found, best = None, (False, False)
        for block in blocks.values():
            if block.token_ids == token_ids:
                key = (block.window_pages is not None, block.ref_cnt > 0)
                if key == (True, True):
                    return block
                if found is None or key > best:
                    found, best = block, key
        return found

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, token_ids: tuple[int, ...]) -> bool:
        """Record a now-full block under its hash (next to any other block with the same contents).
        A block already cached keeps its entry. Returns whether the block was entered."""
        if block.block_hash is not None or block.is_null:
            return False
        block.block_hash, block.token_ids = block_hash, token_ids
        self.cached.setdefault(block_hash, {})[block.block_id] = block
        self.num_cached_blocks += 1
        self.recent.use(block_hash)
        if not block.ref_cnt:  # a free block (a plan undone gives an evicted block its hash back)
            self.states[block.block_id] = CACHED
            self.free_queue.requeue(block)  # among the cached blocks, not the blank ones handed out first
        return True

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Forget a block's hash (its KV was never written: the step that was to write it failed)."""
        self._forget(block)

    def _forget(self, block: KVCacheBlock) -> bool:
        if block.block_hash is None:
            return False
        blocks = self.cached.get(block.block_hash)
        if blocks is not None and blocks.pop(block.block_id, None) is not None:
            self.num_cached_blocks -= 1
            if not blocks:
                del self.cached[block.block_hash]
                self.forget_elsewhere(block.block_hash, self.held_elsewhere)
        block.block_hash = block.token_ids = None
        if not block.ref_cnt:
            self.states[block.block_id] = FREE
        if block.window_pages is not None and not block.holds:
            self.detach(block)  # free pages follow only a cached block
        if block.owner is None:
            self.free_queue.requeue(block)  # free: now blank, handed out first
        return True

    def forget_elsewhere(self, block_hash: BlockHash, held_elsewhere: Callable[[BlockHash], bool] | None = None) -> None:
        """A copy of ``block_hash`` left a place (the pool, or the host tier): unless the pool or
        ``held_elsewhere`` still holds it, it leaves the routing report's hashes."""
        if block_hash not in self.cached and not (held_elsewhere is not None and held_elsewhere(block_hash)):
            self.recent.discard(block_hash)

    def state_bytes(self) -> bytes:
        """One state letter per usable block (ids 1 .. num_blocks - 1), fresh ids included: a copy of
        ``states`` (memcpy speed), no walk over the blocks."""
        return bytes(self.states[1:]) + bytes([FREE]) * self.num_fresh_blocks

    def hashes_by_recency(self, limit: int) -> list[BlockHash]:
        """Up to ``limit`` distinct held hashes (the pool's, and the host tier's where ``held_elsewhere``
        keeps them), most recently used first (``engine/prefix_report.py``: cached, hit or released;
        a chain tail first). Reads ``limit`` entries, never the whole pool."""
        return list(islice(self.recent.by_recency(), max(limit, 0)))

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` from the head of the free queue: blank blocks, then fresh ids, then cached
        blocks (evicting their contents)."""
        blocks = self.free_queue.popleft_n(num_blocks)
        states = self.states
        if len(states) < len(self.blocks):  # fresh ids were made into blocks
            states.extend(bytes([FREE]) * (len(self.blocks) - len(states)))
        for block in blocks:
            if block.owner is not None:  # a free window page: its owner's set is broken up
                self.detach(block.owner)
            if block.window_pages is not None:  # a cached block nobody holds the pages of
                self.detach(block)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            states[block.block_id] = USED
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        """Drop a cached block's contents as it is handed out again."""
        if self.on_evict is not None:
            self.on_evict(block)
        self._forget(block)
        self.num_evictions += 1

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks another request is sharing (prefix hit or fork). Their hashes
        become the most recently used, the chain's first block last (the most recent of all)."""
        blocks = blocks if isinstance(blocks, list) else list(blocks)
        states = self.states
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
            states[block.block_id] = USED if block.ref_cnt == 1 else SHARED
        self.refresh(blocks)

    def refresh(self, chain: list[KVCacheBlock]) -> None:
        """The hashes of these blocks (a run of one request's table) become the most recently used,
        the first block's last: of all of them, the first is the most recent."""
        use = self.recent.use
        for block in reversed(chain):
            if block.block_hash is not None:
                use(block.block_hash)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; those reaching zero join the free queue in this order
        (so pass a request's blocks tail first: its tail is then evicted first, and its first block
        is the most recently used hash)."""
        states, use = self.states, self.recent.use
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
                states[block.block_id] = FREE if block.block_hash is None else CACHED
            elif block.ref_cnt == 1:
                states[block.block_id] = USED
            if block.block_hash is not None:
                use(block.block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.blocks:  # fresh blocks hold no hash
            block.block_hash = block.token_ids = None
            block.window_pages = block.owner = None
        self.free_queue.blank_all()  # all blank now: handed out before the fresh ids, in the same order
        self.cached.clear()
        self.num_cached_blocks = 0
        self.recent.clear()
        self.states[1:] = bytes([FREE]) * (len(self.states) - 1)
        return True

