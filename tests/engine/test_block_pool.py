"""The block pool: exact block ids, LRU eviction order, reference counts, the hash map."""

from __future__ import annotations

import pytest

from engine.block_hash import hash_blocks
from engine.block_pool import BlockPool


def ids(blocks):
    return [b.block_id for b in blocks]


def free_order(pool):
    return [b.block_id for b in pool.free_queue]


def test_blocks_are_handed_out_from_the_head_and_block_zero_is_null():
    pool = BlockPool(6, enable_caching=True)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert free_order(pool) == [1, 2, 3, 4, 5]
    assert ids(pool.get_new_blocks(3)) == [1, 2, 3]
    assert free_order(pool) == [4, 5]
    assert pool.num_free_blocks == 2
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)


def test_cached_blocks_join_the_tail_in_the_order_given():
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(5)
    h = hash_blocks(list(range(20)), 4)
    for i, block in enumerate(blocks):
        pool.cache_block(block, h[i], tuple(range(4 * i, 4 * i + 4)))
    pool.free_blocks(reversed(blocks[:3]))  # a request frees tail first: 3, 2, 1
    assert free_order(pool) == [3, 2, 1]
    pool.free_blocks([blocks[4]])
    assert free_order(pool) == [3, 2, 1, 5]
    assert ids(pool.get_new_blocks(2)) == [3, 2]  # least recently freed first
    assert pool.num_evictions == 2


def test_blank_blocks_are_handed_out_first_most_recently_freed_first():
    """A block freed without a hash holds nothing a request can hit: it goes to the head, before
    the fresh ids and the cached blocks, the last one freed (the warmest) first."""
    pool = BlockPool(8, enable_caching=True)
    blocks = pool.get_new_blocks(5)
    h = hash_blocks(list(range(8)), 4)
    pool.cache_block(blocks[0], h[0], (0, 1, 2, 3))
    pool.cache_block(blocks[1], h[1], (4, 5, 6, 7))
    pool.free_blocks(reversed(blocks[:3]))  # 3 (blank), then 2 and 1 (cached)
    assert free_order(pool) == [3, 6, 7, 2, 1]
    pool.free_blocks([blocks[3], blocks[4]])  # blank: each before the last
    assert free_order(pool) == [5, 4, 3, 6, 7, 2, 1]
    assert ids(pool.get_new_blocks(5)) == [5, 4, 3, 6, 7]  # no eviction: fresh ids before cached blocks
    assert pool.num_evictions == 0 and pool.get_cached_block(h[0], (0, 1, 2, 3)) is blocks[0]
    assert ids(pool.get_new_blocks(1)) == [2] and pool.num_evictions == 1


def test_without_caching_a_freed_block_is_reused_before_any_fresh_one():
    pool = BlockPool(1000, enable_caching=False)
    for _ in range(50):  # requests of 3 blocks, one after another: the same 3 blocks every time
        blocks = pool.get_new_blocks(3)
        assert sorted(ids(blocks)) == [1, 2, 3]
        pool.free_blocks(reversed(blocks))
    assert pool.num_blocks_made == 3 and pool.num_fresh_blocks == 996


def test_a_free_blank_block_given_a_hash_moves_among_the_cached():
    pool = BlockPool(5, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.free_blocks([b, a])
    assert free_order(pool) == [1, 2, 3, 4]
    pool.cache_block(a, hash_blocks([1, 2, 3, 4], 4)[0], (1, 2, 3, 4))  # a plan undone gives a hash back
    assert free_order(pool) == [2, 3, 4, 1]
    assert [blk.block_id for blk in pool.free_queue.blank_blocks()] == [2]


def test_cached_block_stays_cached_while_free_and_is_evicted_on_reuse():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    h = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    pool.cache_block(a, h[0], (1, 2, 3, 4))
    pool.cache_block(b, h[1], (5, 6, 7, 8))
    pool.free_blocks([b, a])
    assert pool.get_cached_block(h[0], (1, 2, 3, 4)) is a  # free, still a hit
    assert free_order(pool) == [3, 2, 1]
    assert ids(pool.get_new_blocks(2)) == [3, 2]  # block 3 was never cached; block 2 (b) is evicted
    assert pool.get_cached_block(h[1], (5, 6, 7, 8)) is None
    assert pool.get_cached_block(h[0], (1, 2, 3, 4)) is a
    assert pool.num_evictions == 1


def test_touch_takes_a_free_block_out_of_the_middle_of_the_queue():
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    h = hash_blocks(list(range(16)), 4)
    for i, block in enumerate(blocks):
        pool.cache_block(block, h[i], tuple(range(4 * i, 4 * i + 4)))
    pool.free_blocks(blocks)
    assert free_order(pool) == [1, 2, 3, 4]
    pool.touch([blocks[2]])
    assert free_order(pool) == [1, 2, 4]
    assert blocks[2].ref_cnt == 1
    pool.touch([blocks[2]])
    assert blocks[2].ref_cnt == 2
    pool.free_blocks([blocks[2]])
    assert blocks[2].ref_cnt == 1 and free_order(pool) == [1, 2, 4]
    pool.free_blocks([blocks[2]])
    assert free_order(pool) == [1, 2, 4, 3]


def test_touch_takes_a_blank_block_out_of_the_head():
    pool = BlockPool(6, enable_caching=False)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks(blocks)  # blank, each before the last: 4, 3, 2, 1
    assert free_order(pool) == [4, 3, 2, 1, 5]
    pool.touch([blocks[1]])  # a fork shares a block
    assert free_order(pool) == [4, 3, 1, 5] and pool.num_free_blocks == 4
    assert ids(pool.get_new_blocks(4)) == [4, 3, 1, 5]


def test_double_free_is_an_error():
    pool = BlockPool(3, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError):
        pool.free_blocks([block])


def test_hash_collision_guard_and_duplicates():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    h = hash_blocks([9, 9, 9, 9], 4)[0]
    pool.cache_block(a, h, (9, 9, 9, 9))
    assert pool.get_cached_block(h, (9, 9, 9, 8)) is None  # same key, other tokens: not a hit
    pool.cache_block(b, h, (9, 9, 9, 9))  # a duplicate of a's content: kept next to it
    assert pool.cached[h] == {a.block_id: a, b.block_id: b} and pool.num_cached_blocks == 2
    pool.free_blocks([a, b])
    assert ids(pool.get_new_blocks(1)) == [3]
    assert ids(pool.get_new_blocks(1)) == [1]  # evicts a: b still holds the contents
    assert pool.cached[h] == {b.block_id: b} and pool.get_cached_block(h, (9, 9, 9, 9)) is b
    assert ids(pool.get_new_blocks(1)) == [2]  # evicts b: the hash leaves the map
    assert h not in pool.cached and pool.num_cached_blocks == 0


def test_a_hit_prefers_a_copy_in_use():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    h = hash_blocks([9, 9, 9, 9], 4)[0]
    pool.cache_block(a, h, (9, 9, 9, 9))
    pool.cache_block(b, h, (9, 9, 9, 9))
    pool.free_blocks([a])
    assert pool.get_cached_block(h, (9, 9, 9, 9)) is b


def test_uncache_forgets_one_copy():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    h = hash_blocks([9, 9, 9, 9], 4)[0]
    pool.cache_block(a, h, (9, 9, 9, 9))
    pool.cache_block(b, h, (9, 9, 9, 9))
    pool.uncache_block(b)
    assert pool.cached[h] == {a.block_id: a} and b.block_hash is None and pool.num_cached_blocks == 1


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(4, enable_caching=True)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, b"x" * 16, (1,))
    assert not pool.reset_prefix_cache()
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() and not pool.cached and a.block_hash is None
