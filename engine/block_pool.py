"""The KV block pool: every block made at start, reference counts, and the LRU free queue.

Invariants (checked by the property tests):
- block 0 is the null block: never handed out, never freed, never in the free queue;
- for every other block: ref_cnt == 0  <=>  the block is in the free queue;
- a block in the hash map has that hash, and carries the token ids it was cached with;
- every block that carries a hash is in the map under it (duplicates too: hash -> {block id: block}).

A freed block keeps its hash until it is handed out again: that is the prefix cache. The free queue
is ordered for eviction, least recently freed at the head::

    head <-> b7 <-> b3 <-> b9 <-> tail        get_new_blocks takes b7 first; free appends at the tail
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from engine.block_hash import BlockHash


class KVCacheBlock:
    """One block of ``block_size`` KV slots (on every rank and layer at once)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev_free", "next_free", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] | None = None  # collision guard for cache hits
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Intrusive doubly linked list of free blocks: O(1) append, popleft and remove-from-middle."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free KV blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def __reversed__(self):
        """Most recently freed first."""
        block = self._tail.prev_free
        while block is not self._head:
            yield block
            block = block.prev_free


class BlockPool:
    """Hands out blocks, takes them back, and keeps the hash -> block map of the prefix cache."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        # hash -> the blocks that hold it: a block computed again (a prompt exactly k blocks long
        # recomputes its last block) is kept as a duplicate, findable once the first copy is evicted
        self.cached: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.num_cached_blocks = 0
        self.num_evictions = 0
        # called with a cached block about to be evicted (hash and token ids still set): the host
        # tier's chance to copy it out
        self.on_evict: Callable[[KVCacheBlock], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

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
        """A block holding ``block_hash`` with these tokens; one in use first (no eviction order to
        disturb), else any."""
        blocks = self.cached.get(block_hash)
        if not blocks:
            return None
        found = None
        for block in blocks.values():
            if block.token_ids == token_ids:
                if block.ref_cnt:
                    return block
                found = found or block
        return found

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, token_ids: tuple[int, ...]) -> bool:
        """Record a now-full block under its hash (next to any other block with the same contents).
        A block already cached keeps its entry. Returns whether the block was entered."""
        if block.block_hash is not None or block.is_null:
            return False
        block.block_hash, block.token_ids = block_hash, token_ids
        self.cached.setdefault(block_hash, {})[block.block_id] = block
        self.num_cached_blocks += 1
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
        block.block_hash = block.token_ids = None
        return True

    def hashes_by_recency(self, limit: int) -> list[BlockHash]:
        """Up to ``limit`` distinct cached hashes, most recently used first: those of blocks in use
        (a hit takes a block into use), then those of free blocks, the latest freed first (the
        reverse of eviction order)."""
        seen: dict[BlockHash, None] = {}
        for block_hash, blocks in self.cached.items():
            if any(b.ref_cnt for b in blocks.values()):
                seen[block_hash] = None
                if len(seen) >= limit:
                    return list(seen)
        for block in reversed(self.free_queue):
            if block.block_hash is not None and block.block_hash not in seen:
                seen[block.block_hash] = None
                if len(seen) >= limit:
                    break
        return list(seen)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` from the head of the free queue (evicting their cached contents)."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} KV blocks with {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if self.on_evict is not None and block.block_hash is not None:
            self.on_evict(block)
        if self._forget(block):
            self.num_evictions += 1

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks another request is sharing (prefix hit or fork)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; those reaching zero join the free queue in this order
        (so pass a request's blocks tail first: its tail is then evicted first)."""
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.blocks:
            block.block_hash = block.token_ids = None
        self.cached.clear()
        self.num_cached_blocks = 0
        return True
