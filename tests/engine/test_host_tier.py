"""The host KV tier, scheduler side: the LRU index, offloads on eviction, restores on a prefix lookup
that misses the pool, undone steps, resets, the router's hash report and the counters, against a
model-free runner that copies its 'KV' between the pool and a fake tier."""

from __future__ import annotations

import pytest

from engine.block_hash import hash_blocks
from engine.host_tier import HostTierIndex
from engine.kv_cache_manager import KVCacheManager
from engine.scheduler import Scheduler
from tests.engine.fakes import FakeRunner, StepFault, make_request

BS = 4


def h(n: int) -> bytes:
    return n.to_bytes(16, "little")


# --- the index alone ---------------------------------------------------------------------------------

def test_a_full_tier_drops_its_least_recently_used_entry():
    tier = HostTierIndex(3)
    slots = [tier.insert(h(i), (i,)).slot for i in range(3)]
    assert slots == [0, 1, 2] and tier.usage == 1.0
    assert tier.lookup(h(0), (0,)).slot == 0  # h0 is now the most recently used; h1 the least
    entry = tier.insert(h(3), (3,))
    assert entry.slot == 1  # h1's slot, reused
    assert h(1) not in tier and tier.lookup(h(1), (1,)) is None
    assert [e.block_hash for e in tier.resident()] == [h(3), h(0), h(2)]
    assert tier.hashes_by_recency(2) == [h(3), h(0)]
    assert tier.num_evictions == 1 and tier.num_resident == 3


def test_pinned_slots_are_never_dropped():
    tier = HostTierIndex(2)
    a, b = tier.insert(h(1), (1,)), tier.insert(h(2), (2,))
    tier.pin(a.slot)
    assert tier.insert(h(3), (3,)).slot == b.slot  # the older entry is pinned: the next one goes
    tier.pin(b.slot)
    assert tier.insert(h(4), (4,)) is None  # every slot pinned: nothing is dropped
    assert {e.block_hash for e in tier.resident()} == {h(1), h(3)}
    tier.unpin(a.slot)
    assert tier.insert(h(4), (4,)).slot == a.slot


def test_the_stored_tokens_guard_against_collisions_and_remove_frees_the_slot():
    tier = HostTierIndex(2)
    entry = tier.insert(h(1), (1, 2))
    assert tier.lookup(h(1), (1, 3)) is None  # same hash, other tokens: not a hit
    assert tier.insert(h(1), (1, 3)) is None  # and no second entry under it
    assert tier.remove(entry) and not tier.remove(entry)
    assert tier.num_resident == 0
    assert tier.insert(h(5), (5,)).slot == entry.slot
    tier.clear()
    assert tier.num_resident == 0 and tier.insert(h(6), (6,)).slot == 0


def test_a_tier_needs_a_block():
    with pytest.raises(ValueError, match="at least 1 block"):
        HostTierIndex(0)


# --- the manager: a scripted sequence with exact counts ------------------------------------------

def prefill(kv, request):
    computed, num_cached = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_cached, computed, num_cached) is not None
    request.num_computed_tokens = request.num_tokens
    return num_cached


def test_evicted_blocks_go_to_the_tier_and_come_back_on_a_lookup():
    kv = KVCacheManager(num_blocks=5, block_size=BS, enable_caching=True, num_host_blocks=8, host_block_bytes=100)
    a = make_request("a", list(range(9)))  # 2 full blocks + 1 token
    assert prefill(kv, a) == 0
    a_blocks = kv.req_to_blocks["a"][:2]
    kv.free(a)  # free queue: [4, a's partial, a1, a0]
    kv.begin_step()
    b = make_request("b", list(range(100, 112)))  # 3 full blocks: takes 4, a's partial and a1
    assert prefill(kv, b) == 0
    offloads, restores = kv.take_tier_copies()
    assert offloads == [(a_blocks[1].block_id, 0)] and restores == []
    assert a_blocks[1].block_hash == kv.req_to_blocks["b"][2].block_hash  # a1 now holds b2
    kv.free(b)  # free queue: [a0, b2, b1, b0]
    kv.begin_step()
    # a again: a0 from the pool, a1 from the tier, restored into the block at the head of the free
    # queue once a0 is held: b2's, which goes to the tier in the same step (offloads run first)
    again = make_request("a2", list(range(9)))
    computed, num_cached = kv.get_computed_blocks(again)
    assert num_cached == 8
    assert computed == a_blocks  # the same two block objects: a0, and a1's block holding a1 again
    assert computed[1].block_hash == hash_blocks(list(range(9)), BS)[1]
    offloads, restores = kv.take_tier_copies()
    assert offloads == [(a_blocks[1].block_id, 1)] and restores == [(0, a_blocks[1].block_id)]
    assert kv.allocate_slots(again, 1, computed, num_cached) is not None
    stats = kv.host_tier_stats()
    assert stats == {
        # a, b and a2 each looked up one block in the tier (a's first, b's first, a2's second)
        "host_kv_cache_queries": 12, "host_kv_cache_hits": 4, "host_kv_cache_hit_blocks": 1,
        # a1, b2 (for the restore) and b1 (for a2's last token)
        "host_kv_cache_offloaded_blocks": 3, "host_kv_cache_evictions": 0,
        "kv_offload_bytes": 300, "kv_restore_bytes": 100,
        "host_kv_cache_blocks": 8, "host_kv_cache_blocks_used": 3, "host_kv_cache_usage": 3 / 8,
    }


def test_the_tier_off_reports_zeros_and_changes_nothing():
    kv = KVCacheManager(num_blocks=5, block_size=BS, enable_caching=True)
    assert kv.host_tier is None and kv.block_pool.on_evict is None
    assert kv.host_tier_stats()["host_kv_cache_blocks"] == 0
    assert kv.take_tier_copies() == ([], [])


def test_a_block_held_twice_in_the_pool_or_already_in_the_tier_is_not_copied_again():
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_caching=True, num_host_blocks=8)
    prompt = list(range(8))  # exactly 2 blocks: a second request recomputes the last one
    prefill(kv, a := make_request("a", prompt))
    prefill(kv, b := make_request("b", prompt))
    a0, a1 = kv.req_to_blocks["a"]
    b1 = kv.req_to_blocks["b"][1]
    assert kv.req_to_blocks["b"][0] is a0 and b1 is not a1 and b1.block_hash == a1.block_hash
    kv.free(b)
    kv.free(a)  # free queue: [2 others, b1, a1, a0]
    kv.take_tier_copies()
    prefill(kv, c := make_request("c", list(range(100, 112))))  # 3 blocks: 2 uncached, then b1
    assert kv.take_tier_copies() == ([], [])  # a1 still holds b1's contents
    prefill(kv, d := make_request("d", list(range(200, 204))))  # takes a1: now the last copy
    assert kv.take_tier_copies() == ([(a1.block_id, 0)], [])
    kv.free(d)
    kv.free(c)
    kv.begin_step()
    computed, _ = kv.get_computed_blocks(make_request("e", prompt + [9]))  # a1's hash from the tier
    first_offloads, restores = kv.take_tier_copies()
    assert computed[0] is a0 and restores == [(0, computed[1].block_id)]
    # the block the restore took held d's block: copied out first, in the same step
    assert first_offloads == [(computed[1].block_id, 1)]
    kv.begin_step()
    queue = [blk.block_id for blk in kv.block_pool.free_queue]
    restored_at = queue.index(computed[1].block_id)
    # enough blocks to reach the restored one in the free queue: every cached one before it is copied out
    prefill(kv, make_request("f", list(range(300, 300 + 4 * (restored_at + 1)))))
    offloads, _ = kv.take_tier_copies()
    # evicted (now holding f's tokens): the tier still has its contents, so they are not copied again
    assert computed[1].ref_cnt == 1 and computed[1].block_hash == hash_blocks(list(range(300, 400)), BS)[restored_at]
    assert computed[1].block_id not in [blk for blk, _ in offloads]
    assert kv.host_tier.num_resident == 1 + len(first_offloads) + len(offloads)
    assert kv.tier_stats.offloaded == kv.host_tier.num_resident


def test_an_undone_step_leaves_no_tier_entry_and_no_restored_block():
    kv = KVCacheManager(num_blocks=5, block_size=BS, enable_caching=True, num_host_blocks=4)
    a = make_request("a", list(range(9)))
    prefill(kv, a)
    a_blocks = kv.req_to_blocks["a"]
    kv.free(a)
    kv.begin_step()
    b = make_request("b", list(range(100, 112)))
    prefill(kv, b)
    b_blocks = list(kv.req_to_blocks["b"])
    assert kv.take_tier_copies() == ([(a_blocks[1].block_id, 0)], [])
    kv.rollback_step()  # the step that carried the offload did not run
    assert kv.host_tier.num_resident == 0 and kv.tier_stats.offloaded == 0
    assert kv.host_tier_stats()["kv_offload_bytes"] == 0
    kv.free(b)
    # now one that ran (b's blocks left the cache with the undone step: blank, they are handed out
    # first; b2, one token longer than b, takes them and evicts a0), then a restore in a step that fails
    kv.begin_step()
    prefill(kv, b2 := make_request("b2", list(range(100, 113))))
    b2_blocks = list(kv.req_to_blocks["b2"])
    assert b2_blocks == b_blocks + [a_blocks[0]]  # the blank ones (freed tail first: the first at the head)
    assert kv.take_tier_copies() == ([(a_blocks[0].block_id, 0)], [])
    kv.free(b2)
    kv.begin_step()  # the offload ran
    resident = kv.host_tier.resident()
    assert [e.block_hash for e in resident] == [hash_blocks(list(range(9)), BS)[0]]
    computed, num_cached = kv.get_computed_blocks(make_request("c", list(range(9))))
    assert num_cached == 4 and computed[0].block_hash == resident[0].block_hash  # a1 was never offloaded
    assert computed[0] is b2_blocks[3]  # the free queue's head: b2's partial block, blank
    assert kv.take_tier_copies() == ([], [(0, computed[0].block_id)])
    assert kv.tier_stats.hits == 1 and kv.host_tier.is_pinned(0)
    kv.rollback_step()
    assert computed[0].block_hash is None  # its KV never arrived
    assert kv.host_tier.resident() == resident  # the tier still holds a0
    assert not kv.host_tier.is_pinned(resident[0].slot)
    assert kv.tier_stats.hits == 0 and kv.tier_stats.offloaded == 1


def test_reset_forgets_the_tier_and_the_report_lists_tier_hashes_after_the_pool():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=True, num_host_blocks=4)
    a = make_request("a", list(range(9)))
    prefill(kv, a)
    kv.free(a)
    kv.begin_step()
    prefill(kv, b := make_request("b", list(range(100, 109))))  # evicts both of a's full blocks
    kv.take_tier_copies()
    ha, hb = hash_blocks(list(range(9)), BS), hash_blocks(list(range(100, 109)), BS)
    digest = kv.cached_hash_digest(16)
    # the pool's (b's, in use), then the tier's, the latest offloaded first (a1 went first, then a0)
    assert digest == b"".join(x[:8] for x in (hb[0], hb[1], ha[0], ha[1]))
    assert kv.cached_hash_digest(3) == digest[:24]
    kv.free(b)
    kv.begin_step()
    assert kv.reset_prefix_cache()
    assert kv.host_tier.num_resident == 0 and kv.cached_hash_digest(16) == b""


def test_cache_salt_keeps_tenants_apart_in_the_tier():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=True, num_host_blocks=4)
    prefill(kv, a := make_request("a", list(range(9)), cache_salt="x"))
    kv.free(a)
    prefill(kv, b := make_request("b", list(range(100, 109))))
    kv.free(b)
    kv.take_tier_copies()
    kv.begin_step()
    assert kv.host_tier.num_resident == 2
    assert kv.get_computed_blocks(make_request("c", list(range(9)), cache_salt="y"))[1] == 0
    assert kv.get_computed_blocks(make_request("d", list(range(9))))[1] == 0
    assert kv.get_computed_blocks(make_request("e", list(range(9)), cache_salt="x"))[1] == 8


def test_a_lookup_never_evicts_the_chain_it_is_building():
    """The pool's hits of a chain sit in the free queue; a restore for the next block must not take
    one of them: with no other free block the chain stops before the tier's block."""
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_caching=True, num_host_blocks=4)
    prompt = list(range(13))  # 3 full blocks + 1
    prefill(kv, a := make_request("a", prompt))
    a0, a1, a2, _ = kv.req_to_blocks["a"]
    kv.free(a)  # free queue: [block 5, a's partial, a2, a1, a0]
    prefill(kv, hold := make_request("hold", list(range(300, 312))))  # takes 5, the partial and a2
    assert a2.block_hash != hash_blocks(prompt, BS)[2] and kv.host_tier.num_resident == 1
    kv.take_tier_copies()
    kv.begin_step()
    queries = kv.tier_stats.queries
    computed, num_cached = kv.get_computed_blocks(make_request("a2", prompt))
    assert computed == [a0, a1] and num_cached == 8  # only a1 and a0 were free: no room to restore
    assert [blk.block_hash for blk in computed] == hash_blocks(prompt, BS)[:2]
    assert kv.take_tier_copies() == ([], [])
    assert kv.tier_stats.queries == queries + 1 and kv.tier_stats.hits == 0
    kv.free(hold)
    computed, num_cached = kv.get_computed_blocks(make_request("a3", prompt))
    assert num_cached == 12 and computed[:2] == [a0, a1]
    assert [blk.block_hash for blk in computed] == hash_blocks(prompt, BS)[:3]
    assert kv.take_tier_copies()[1] == [(0, computed[2].block_id)]
    assert all(blk.ref_cnt == 0 for blk in computed)  # a lookup holds nothing once it returns


# --- the scheduler with a runner that copies: tokens and 'KV' stay right through everything -------

class TierRunner(FakeRunner):
    """FakeRunner plus a host tier of its own: a step's offloads, then its restores, run before the
    diffs and the forward, as on a real rank."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.tier: dict[int, dict[int, int]] = {}
        self.copies = 0

    def execute_model(self, so, fail=None):
        if fail != "before":
            for block, slot in so.kv_offloads:
                self.tier[slot] = dict(self.kv.get(block, {}))
            for slot, block in so.kv_restores:
                self.kv[block] = dict(self.tier[slot])
            self.copies += len(so.kv_offloads) + len(so.kv_restores)
        return super().execute_model(so, fail)


def tier_scheduler(num_blocks=9, num_host=16, budget=64):
    return Scheduler(num_kv_blocks=num_blocks, block_size=BS, enable_prefix_caching=True, max_num_seqs=4,
                     max_num_batched_tokens=budget, max_model_len=64, num_host_kv_blocks=num_host)


def run_all(sched, runner, requests):
    for r in requests:
        sched.add_request(r)
    outputs = {}
    while sched.has_unfinished_requests():
        so = sched.schedule()
        if so.is_empty:
            continue
        for out in sched.update_from_output(so, runner.execute_model(so)):
            outputs.setdefault(out.req_id, []).extend(out.new_token_ids)
    return outputs


def assert_tier_holds_its_tokens(sched, runner):
    pending = {c.entry.slot for c in sched.kv._pending_copies}
    for entry in sched.kv.host_tier.resident():
        if entry.slot not in pending:
            assert tuple(runner.tier[entry.slot].get(i) for i in range(BS)) == entry.token_ids


def conversation(turns: int, user: int) -> list[list[int]]:
    history, prompts = [], []
    for t in range(turns):
        history = history + [1 + (user * 13 + t * 5 + i) % 47 for i in range(8)]
        prompts.append(list(history))
    return prompts


def test_multi_turn_conversations_come_back_from_the_tier_with_the_same_tokens():
    """Four users, three turns each, a pool of 8 blocks: every turn evicts the others' history, the
    tier brings it back. Tokens equal a run with an unlimited pool and one without a tier, and the
    prefix hits equal the unlimited pool's: turn 1 finds turn 0's 8 prompt tokens, turn 2 turn 1's 16."""
    users = [conversation(3, u) for u in range(4)]
    results = {}
    for name, blocks, host in (("tier", 9, 32), ("big", 200, 0), ("small", 9, 0)):
        sched, runner = tier_scheduler(blocks, host), TierRunner(BS)
        tokens = {}
        for turn in range(3):
            reqs = [make_request(f"u{u}t{turn}", users[u][turn], max_tokens=3, block_size=BS) for u in range(4)]
            tokens.update(run_all(sched, runner, reqs))
            if host:
                assert_tier_holds_its_tokens(sched, runner)
        results[name] = (tokens, sched.stats.prefix_cache_hits, sched.kv.host_tier_stats(), runner.copies)
    assert results["tier"][0] == results["big"][0] == results["small"][0]
    assert results["big"][1] == results["tier"][1] == 4 * (8 + 16)
    assert results["small"][1] < 4 * (8 + 16)
    stats = results["tier"][2]
    assert stats["host_kv_cache_hit_blocks"] * BS == stats["host_kv_cache_hits"] > 0
    assert stats["host_kv_cache_offloaded_blocks"] > 0
    assert results["tier"][3] == stats["host_kv_cache_hit_blocks"] + stats["host_kv_cache_offloaded_blocks"]
    assert results["big"][3] == results["small"][3] == 0


@pytest.mark.parametrize("where", ["before", "after_update", "after_forward"])
def test_a_failed_step_undoes_its_copies_and_the_retry_gives_the_same_tokens(where):
    users = [conversation(2, u) for u in range(3)]
    runs = []
    for fail in (False, True):
        sched, runner = tier_scheduler(7, 16), TierRunner(BS)
        run_all(sched, runner, [make_request(f"u{u}t0", users[u][0], max_tokens=2, block_size=BS) for u in range(3)])
        for u in range(3):
            sched.add_request(make_request(f"u{u}t1", users[u][1], max_tokens=2, block_size=BS))
        if fail:
            resident, hits = set(sched.kv.host_tier.resident()), sched.kv.tier_stats.hits
            so = sched.schedule()
            assert so.kv_restores, "the second turn restores history from the tier"
            with pytest.raises(StepFault):
                runner.execute_model(so, fail=where)
            sched.rollback(so)
            assert sched.kv.tier_stats.hits == hits  # the restores were taken back
            assert set(sched.kv.host_tier.resident()) <= resident  # no entry of the failed step stays
            for slot, block in so.kv_restores:
                assert sched.kv.block_pool.blocks[block].block_hash is None
        tokens = run_all(sched, runner, [])
        assert_tier_holds_its_tokens(sched, runner)
        assert sched.kv.block_pool.num_free_blocks == sched.kv.block_pool.num_usable_blocks
        runs.append((tokens, sched.stats.prefix_cache_hits, sched.kv.tier_stats.hits))
    assert runs[0][0] == runs[1][0]
    assert runs[0][2] > 0 and runs[1][2] > 0


def test_worker_recovery_forgets_the_tier():
    sched, runner = tier_scheduler(7, 16), TierRunner(BS)
    users = [conversation(2, u) for u in range(3)]
    run_all(sched, runner, [make_request(f"u{u}t0", users[u][0], max_tokens=2, block_size=BS) for u in range(3)])
    run_all(sched, runner, [make_request(f"v{u}", users[u][1][::-1], max_tokens=2, block_size=BS) for u in range(3)])
    assert sched.kv.host_tier.num_resident > 0
    sched.add_request(make_request("w", users[0][1], max_tokens=2, block_size=BS))
    sched.schedule()  # the step that is lost with the ranks
    sched.recompute_all()
    assert sched.kv.host_tier.num_resident == 0 and sched.kv.cached_hash_digest(64) == b""
    so = sched.schedule()
    assert so.kv_restores == [] and so.num_scheduled_tokens == {"w": len(users[0][1])}
