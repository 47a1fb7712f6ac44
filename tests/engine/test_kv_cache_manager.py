"""KV cache manager: prefix hits, the num_tokens - 1 cap, allocation that fails cleanly, freeing."""

from __future__ import annotations

from engine.kv_cache_manager import KVCacheManager
from tests.engine.fakes import make_request


def table(kv, request):
    return kv.get_block_ids(request.request_id)


def run_prefill(kv, request):
    computed, num_cached = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_cached, computed, num_cached) is not None
    request.num_computed_tokens = request.num_tokens
    return num_cached


def test_second_request_hits_the_first_ones_full_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    a = make_request("a", list(range(10)))  # blocks: [0..3] [4..7] [8 9]
    assert run_prefill(kv, a) == 0
    assert table(kv, a) == [1, 2, 3]
    b = make_request("b", list(range(8)) + [50, 51, 52])
    assert run_prefill(kv, b) == 8
    assert table(kv, b) == [1, 2, 4]
    assert [kv.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]


def test_hit_is_capped_one_token_short_of_the_request():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    run_prefill(kv, make_request("a", list(range(8))))
    same = make_request("b", list(range(8)))  # identical: 2 full blocks cached
    computed, num_cached = kv.get_computed_blocks(same)
    assert num_cached == 4 and len(computed) == 1


def test_cache_salt_isolates_tenants():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    run_prefill(kv, make_request("a", list(range(9)), cache_salt="x"))
    assert kv.get_computed_blocks(make_request("b", list(range(9)), cache_salt="y"))[1] == 0
    assert kv.get_computed_blocks(make_request("c", list(range(9))))[1] == 0
    assert kv.get_computed_blocks(make_request("d", list(range(9)), cache_salt="x"))[1] == 8


def test_allocation_that_does_not_fit_returns_none_and_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=True)  # 3 usable
    a = make_request("a", list(range(8)))
    run_prefill(kv, a)
    b = make_request("b", list(range(100, 109)))  # needs 3 blocks, 1 free
    assert kv.allocate_slots(b, 9) is None
    assert kv.block_pool.num_free_blocks == 1
    assert "b" not in kv.req_to_blocks


def test_free_releases_tail_first_so_the_tail_is_evicted_first():
    kv = KVCacheManager(num_blocks=5, block_size=4, enable_caching=True)
    a = make_request("a", list(range(12)))
    run_prefill(kv, a)
    kv.free(a)
    assert [b.block_id for b in kv.block_pool.free_queue] == [4, 3, 2, 1]
    # a request sharing the first block evicts a's tail, not its head
    b = make_request("b", list(range(4)) + [77, 78])
    assert run_prefill(kv, b) == 4
    assert table(kv, b) == [1, 4]
    c = make_request("c", list(range(8)) + [5])
    assert run_prefill(kv, c) == 8  # blocks 1 and 2 still cached


def test_shared_free_block_counts_against_the_free_budget():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=True)  # 3 usable
    a = make_request("a", list(range(5)))
    run_prefill(kv, a)
    kv.free(a)  # block 1 cached and free, 2 free
    b = make_request("b", list(range(4)) + list(range(100, 108)))  # hit 1 block, needs 2 more
    computed, n = kv.get_computed_blocks(b)
    assert n == 4
    # 3 free blocks, but one of them is the hit itself: 2 remain for the 2 new ones
    assert kv.allocate_slots(b, 8, computed, n) is not None
    assert kv.block_pool.num_free_blocks == 0


def test_no_caching_means_no_hits():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    run_prefill(kv, make_request("a", list(range(9))))
    assert kv.get_computed_blocks(make_request("b", list(range(9))))[1] == 0
    assert not kv.block_pool.cached


def test_a_prompt_exactly_k_blocks_long_keeps_its_recomputed_last_block():
    """The second copy of a two-block prompt hits one block (the cap) and recomputes the second into
    a block of its own: that copy is cached too, and serves a hit once the first copy is evicted."""
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    prompt = list(range(8))
    a = make_request("a", prompt)
    run_prefill(kv, a)
    b = make_request("b", prompt)
    assert run_prefill(kv, b) == 4
    a_blocks, b_blocks = table(kv, a), table(kv, b)
    assert a_blocks[0] == b_blocks[0] and a_blocks[1] != b_blocks[1]
    pool = kv.block_pool
    assert pool.num_cached_blocks == 3 and len(pool.cached[b.block_hashes[1]]) == 2
    kv.free(a)  # a's copy of the last block joins the free queue before b's
    kv.free(b)
    assert [blk.block_id for blk in pool.free_queue][-3:] == [a_blocks[1], b_blocks[1], b_blocks[0]]
    filler = make_request("f", [40 + i for i in range(4 * (pool.num_free_blocks - 2))])
    run_prefill(kv, filler)  # takes every free block up to a's copy, evicting it
    assert a_blocks[1] in table(kv, filler)
    assert list(pool.cached[b.block_hashes[1]]) == [b_blocks[1]]
    kv.free(filler)
    c = make_request("c", prompt + [99])
    assert run_prefill(kv, c) == 8  # both blocks hit: the second from b's copy
    assert table(kv, c)[:2] == [b_blocks[0], b_blocks[1]]
