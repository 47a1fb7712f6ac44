"""The block pool makes a block only when its id is first handed out, and behaves exactly as a pool
that made every block at start (each blank, never used): the same ids in the same order, the same
evictions, the same hits."""

from __future__ import annotations

import itertools
import random
import time
import tracemalloc

import pytest

import engine.block_pool as block_pool
import engine.free_queue as free_queue
from engine.block_pool import BlockPool, FreshBlock


class EagerPool:
    """A pool with every block id free from the start, in plain lists: the order to match. Blank
    blocks (no hash when freed; at start, all of them) are handed out first, the last freed first,
    then the cached ones, least recently freed first."""

    def __init__(self, num_blocks: int) -> None:
        self.blank = list(range(1, num_blocks))  # hand-out order, head first
        self.lru: list[int] = []
        self.ref = [0] * num_blocks
        self.hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, dict[int, None]] = {}  # hash -> block ids, in the order cached
        self.num_evictions = 0

    @property
    def free(self) -> list[int]:
        return self.blank + self.lru

    def get_new(self, n: int) -> list[int]:
        out = self.free[:n]
        taken = min(n, len(self.blank))
        self.blank, self.lru = self.blank[taken:], self.lru[n - taken:]
        for i in out:
            if self.hash[i] is not None:
                self._forget(i)
                self.num_evictions += 1
            self.ref[i] = 1
        return out

    def free_ids(self, ids: list[int]) -> None:
        for i in ids:
            self.ref[i] -= 1
            if self.ref[i] == 0:
                if self.hash[i] is None:
                    self.blank.insert(0, i)
                else:
                    self.lru.append(i)

    def touch(self, i: int) -> None:
        if self.ref[i] == 0:
            (self.blank if i in self.blank else self.lru).remove(i)
        self.ref[i] += 1

    def cache(self, i: int, h: int) -> None:
        if self.hash[i] is None:
            self.hash[i] = h
            self.cached.setdefault(h, {})[i] = None

    def _forget(self, i: int) -> None:
        ids = self.cached[self.hash[i]]
        del ids[i]
        if not ids:
            del self.cached[self.hash[i]]
        self.hash[i] = None

    def place(self, i: int) -> None:
        """A free block whose hash changed takes the place that fits it now."""
        if self.ref[i] == 0:
            (self.blank if i in self.blank else self.lru).remove(i)
            if self.hash[i] is None:
                self.blank.insert(0, i)
            else:
                self.lru.append(i)

    def uncache(self, i: int) -> None:
        if self.hash[i] is not None:
            self._forget(i)
            self.place(i)

    def cache_free(self, i: int, h: int) -> None:
        """A free blank block given a hash (a plan undone gives an evicted block its hash back)."""
        self.cache(i, h)
        self.place(i)

    def reset(self, made: set[int]) -> None:
        """Every hash forgotten (all blocks free): the made blocks blank, in their order, before the rest."""
        order = self.free
        for i in order:
            if self.hash[i] is not None:
                self._forget(i)
        self.blank = [i for i in order if i in made] + [i for i in order if i not in made]
        self.lru = []

    def hit(self, h: int) -> int | None:
        ids = list(self.cached.get(h, ()))
        in_use = [i for i in ids if self.ref[i]]
        return (in_use or ids or [None])[0]


def key(h: int) -> bytes:
    return h.to_bytes(16, "little")


@pytest.mark.parametrize("seed", range(12))
def test_ids_evictions_and_hits_match_a_pool_that_made_every_block_at_start(seed, monkeypatch):
    made = []

    class CountedBlock(block_pool.KVCacheBlock):
        __slots__ = ()

        def __init__(self, block_id: int) -> None:
            super().__init__(block_id)
            made.append(block_id)

    monkeypatch.setattr(block_pool, "KVCacheBlock", CountedBlock)  # the null block
    monkeypatch.setattr(free_queue, "KVCacheBlock", CountedBlock)  # every other (and the chains' sentinels)
    rng = random.Random(seed)
    num_blocks = rng.randint(6, 40)
    pool, ref = BlockPool(num_blocks, enable_caching=True), EagerPool(num_blocks)
    held: list[list] = []  # each a request's blocks, in table order
    handed_out: list[int] = []
    for _ in range(400):
        op = rng.random()
        if op < 0.35 and pool.num_free_blocks:
            n = rng.randint(1, min(5, pool.num_free_blocks))
            blocks = pool.get_new_blocks(n)
            assert [b.block_id for b in blocks] == ref.get_new(n)
            handed_out += [b.block_id for b in blocks]
            held.append(blocks)
        elif op < 0.6 and held:
            blocks = held.pop(rng.randrange(len(held)))
            pool.free_blocks(reversed(blocks))  # tail first, as a request frees
            ref.free_ids([b.block_id for b in reversed(blocks)])
        elif op < 0.8 and held:
            block = rng.choice(rng.choice(held))
            h = rng.randrange(6)  # few hashes: duplicates and collisions of contents are common
            pool.cache_block(block, key(h), (h,))
            ref.cache(block.block_id, h)
        elif op < 0.84 and len(pool.blocks) > 1:  # a hash forgotten (a step undone), the block held or free
            block = rng.choice(pool.blocks[1:])
            pool.uncache_block(block)
            ref.uncache(block.block_id)
        elif op < 0.87 and len(pool.blocks) > 1:  # a free blank block given a hash back
            block = rng.choice(pool.blocks[1:])
            if block.ref_cnt == 0 and block.block_hash is None:
                h = rng.randrange(6)
                pool.cache_block(block, key(h), (h,))
                ref.cache_free(block.block_id, h)
        elif op < 0.88 and not held:  # everything free: the prefix cache reset
            assert pool.reset_prefix_cache()
            ref.reset(set(range(1, len(pool.blocks))))
        else:
            h = rng.randrange(6)
            block = pool.get_cached_block(key(h), (h,))
            assert (block and block.block_id) == ref.hit(h)
            if block is not None:
                pool.touch([block])
                ref.touch(block.block_id)
                held.append([block])
        assert [b.block_id for b in pool.free_queue] == ref.free
        assert pool.num_free_blocks == len(ref.free) and pool.num_evictions == ref.num_evictions
        assert {k: list(v) for k, v in pool.cached.items()} == {key(h): list(v) for h, v in ref.cached.items()}
        # one block made per id ever handed out, each once, and those are ids 1 .. k in order
        first_use = list(dict.fromkeys(handed_out))
        assert first_use == list(range(1, len(first_use) + 1))
        assert [i for i in made if i >= 0] == [0] + first_use
        assert [b.block_id for b in pool.blocks] == [0] + first_use
        assert pool.num_fresh_blocks == num_blocks - 1 - len(first_use)
    assert len(set(handed_out)) > 3 and ref.num_evictions + len(ref.cached) > 0  # the run did reuse and cache


def test_a_pool_of_two_million_blocks_makes_only_the_null_block():
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        pool = BlockPool(2_000_000, enable_caching=True)
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10  # host memory: 1.3 KiB measured here (a block object each: 128 B x 2M = 256 MB)
    assert [b.block_id for b in pool.blocks] == [0] and pool.blocks[0] is pool.null_block
    assert pool.num_free_blocks == pool.num_fresh_blocks == 1_999_999
    assert pool.num_used_blocks == 0 and pool.usage == 0.0
    assert elapsed < 1.0  # O(1): a pool that made every block took seconds here
    assert [b.block_id for b in itertools.islice(pool.free_queue, 3)] == [1, 2, 3]
    assert [b.block_id for b in itertools.islice(reversed(pool.free_queue), 2)] == [1_999_999, 1_999_998]
    blocks = pool.get_new_blocks(16)
    assert [b.block_id for b in blocks] == list(range(1, 17)) and len(pool.blocks) == 17
    assert pool.num_free_blocks == 1_999_983 and pool.num_fresh_blocks == 1_999_983
    pool.free_blocks(reversed(blocks))  # blank: reused first, 1 (the last freed) at the head
    assert pool.num_free_blocks == 1_999_999 and pool.num_fresh_blocks == 1_999_983
    assert [b.block_id for b in itertools.islice(pool.free_queue, 3)] == [1, 2, 3]
    assert [b.block_id for b in itertools.islice(reversed(pool.free_queue), 2)] == [1_999_999, 1_999_998]
    assert [b.block_id for b in pool.get_new_blocks(17)] == list(range(1, 18)) and len(pool.blocks) == 18


def test_fresh_blocks_are_listed_as_free_uncached_stand_ins_between_the_blank_and_the_cached_blocks():
    pool = BlockPool(7, enable_caching=True)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(c, b"h" * 16, (1,))
    pool.free_blocks([c, b, a])
    listed = list(pool.free_queue)
    assert [type(x) for x in listed] == [block_pool.KVCacheBlock, block_pool.KVCacheBlock, FreshBlock, FreshBlock,
                                         FreshBlock, block_pool.KVCacheBlock]
    assert [x.block_id for x in listed] == [1, 2, 4, 5, 6, 3] and listed[0] is a and listed[1] is b
    assert listed[5] is c
    assert all(x.ref_cnt == 0 and x.block_hash is None and not x.is_null for x in listed[2:5])
    assert [x.block_id for x in reversed(pool.free_queue)] == [3, 6, 5, 4, 2, 1]
    assert list(pool.free_queue.blank_blocks()) == [a, b]
    with pytest.raises(RuntimeError, match="not in the free queue"):
        pool.touch([listed[2]])  # a stand-in is not the block: the pool refuses it


def test_the_last_fresh_block_then_the_cached_ones():
    pool = BlockPool(4, enable_caching=True)
    first = pool.get_new_blocks(2)
    for i, block in enumerate(first):
        pool.cache_block(block, bytes([i]) * 16, (i,))
    pool.free_blocks(first)
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 1]  # fresh 3, then the oldest freed
    assert pool.num_fresh_blocks == 0 and len(pool.blocks) == 4
    with pytest.raises(ValueError, match="asked for 2 KV blocks with 1 free"):
        pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="asked for -1 KV blocks with 1 free"):
        pool.get_new_blocks(-1)
    assert pool.get_new_blocks(0) == [] and pool.num_free_blocks == 1
    assert pool.free_queue.popleft() is first[1]
    with pytest.raises(ValueError, match="no free KV blocks"):
        pool.free_queue.popleft()
