"""The routing report kept incrementally (engine/prefix_report.py): the reported set as the top of a
recency order, the change log a reader follows with a cursor, and the reporter's base + changes.
Also the block pool's state bytes (what the dashboard copies) against a walk over the blocks."""

from __future__ import annotations

import random

import pytest

from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.kv_map import block_states
from engine.prefix_report import ADDED, REMOVED, PrefixReport, RecentHashes
from tests.engine.fakes import make_request

BS = 4


def h(i: int) -> bytes:
    return bytes([i]) * 16


def k(i: int) -> bytes:
    return bytes([i]) * 8  # the 8-byte key a router gets


def test_the_set_is_an_lru_of_the_limit_and_each_membership_change_is_logged_once():
    r = RecentHashes(limit=2, log_limit=3)
    for i in (1, 2, 3):
        r.use(h(i))
    assert list(r.by_recency()) == [h(3), h(2)]
    first = r.read(None)
    assert first.cursor == 4 and first.full == [h(3), h(2)]  # +1 +2 +3 -1
    r.use(h(3))  # already reported: no entry
    assert r.read(4) == (4, None, [], b"")
    r.use(h(1))  # used again: it joins, the least recent leaves
    assert r.read(4) == (6, None, [h(1), h(2)], bytes([ADDED, REMOVED]))
    assert list(r.by_recency()) == [h(1), h(3)]
    r.discard(h(3))  # nothing holds it: it goes, and its place stays empty
    r.discard(h(2))  # not in the set: nothing
    assert list(r.by_recency()) == [h(1)] and r.read(6) == (7, None, [h(3)], bytes([REMOVED]))
    r.use(h(2))
    r.discard(h(1))
    assert len(r) == 1 and r.read(7) == (9, None, [h(2), h(1)], bytes([ADDED, REMOVED]))


def test_the_log_is_bounded_and_a_cursor_it_no_longer_reaches_gets_the_whole_set():
    r = RecentHashes(limit=2, log_limit=3)
    cursor = r.read(None).cursor
    for i in range(1, 40):
        r.use(h(i))
        assert r.log_size <= 6
    late = r.read(cursor)
    assert late.full == [h(39), h(38)] and late.hashes == []
    tail = r.read(late.cursor - 2)  # within the log: the last two entries (+39, -37)
    assert tail.full is None and tail.hashes == [h(39), h(37)] and tail.ops == bytes([ADDED, REMOVED])
    r.clear()
    assert r.read(late.cursor).full == [] and r.read(late.cursor + 1).full is None  # after a clear: whole


def test_the_reporter_sends_a_base_and_the_net_changes_since():
    r = RecentHashes(limit=3)
    report = PrefixReport(r.read, rebase_after=3)
    for i in (1, 2):
        r.use(h(i))
    assert report.report() == {"prefix_hashes": k(2) + k(1), "prefix_added": b"", "prefix_removed": b""}
    r.use(h(3))
    r.discard(h(1))
    r.use(h(1))  # removed, then added back: no net change
    assert report.report() == {"prefix_hashes": k(2) + k(1), "prefix_added": k(3), "prefix_removed": b""}
    r.use(h(4))  # the top is full: 2 leaves
    assert report.report() == {"prefix_hashes": k(2) + k(1), "prefix_added": k(3) + k(4), "prefix_removed": k(2)}
    r.use(h(5))  # +5 -3: 3 was added since the base, so it simply goes
    r.use(h(6))  # +6 -1: 5 net changes > rebase_after: a new base, built from what the reporter holds
    assert report.report() == {"prefix_hashes": k(4) + k(5) + k(6), "prefix_added": b"", "prefix_removed": b""}
    assert {x[:8] for x in r.top} == report.hashes() == {k(4), k(5), k(6)}
    assert report.num_full_reads == 1


def prompt(rng: random.Random) -> list[int]:
    system = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 8, 8, 8, 8, 7, 7, 7, 7], [5, 6, 7, 8]][rng.randrange(3)]
    return system + [rng.randrange(20, 40) for _ in range(rng.randrange(1, 9))]


class Replica:
    """A KV manager driven at random: prefix hits, frees, evictions, the host tier, undone steps."""

    def __init__(self, seed: int, limit: int, host_blocks: int = 6) -> None:
        self.rng = random.Random(seed)
        self.kv = KVCacheManager(num_blocks=24, block_size=BS, enable_caching=True, num_host_blocks=host_blocks)
        self.kv.block_pool.recent = RecentHashes(limit, log_limit=8)  # small: the log overflows too
        self.live: list = []
        self.n = 0
        self.resets = 0

    def step(self) -> None:
        kv, rng = self.kv, self.rng
        op = rng.random()
        if op < 0.5:
            self.n += 1
            request = make_request(f"r{self.n}", prompt(rng), block_size=BS)
            computed, cached = kv.get_computed_blocks(request)
            if kv.allocate_slots(request, request.num_tokens - cached, computed, cached) is not None:
                request.num_computed_tokens = request.num_tokens
                self.live.append(request)
        elif op < 0.85 and self.live:
            kv.free(self.live.pop(rng.randrange(len(self.live))))
        elif op < 0.9:
            kv.take_tier_copies()
            kv.rollback_step()  # the step did not run: what it cached leaves the cache
        elif op < 0.93 and not self.live:
            kv.begin_step()
            assert kv.reset_prefix_cache()
            self.resets += 1
        else:
            kv.take_tier_copies()
            kv.begin_step()

    def held(self) -> set[bytes]:
        tier = self.kv.host_tier
        return set(self.kv.block_pool.cached) | {e.block_hash for e in tier.resident()}


@pytest.mark.parametrize("seed", range(4))
def test_the_report_follows_the_pool_and_the_tier_through_a_random_run(seed):
    """After every change: the set holds only hashes the pool or the tier holds (all of them until
    more than the limit were held); the reporter's base + changes is that set; the state bytes are what a walk over the
    blocks reads."""
    replica = Replica(seed, limit=8)
    kv, recent = replica.kv, replica.kv.block_pool.recent
    report = PrefixReport(recent.read, rebase_after=3)
    overflowed, resets = False, 0  # did more than 8 hashes get held since the last reset?
    for _ in range(400):
        replica.step()
        held = replica.held()
        if replica.resets != resets:
            overflowed, resets = False, replica.resets
        overflowed = overflowed or len(held) > 8
        assert set(recent.top) <= held and len(recent.top) <= 8
        if not overflowed:  # everything held fits: the set is all of it
            assert set(recent.top) == held
        assert recent.log_size <= 16
        report.report()
        assert report.hashes() == {x[:8] for x in recent.top}
        pool = kv.block_pool
        assert pool.state_bytes().decode() == block_states(pool.blocks[1:]) + "f" * pool.num_fresh_blocks
    assert report.num_full_reads > 1  # the small log overflowed: whole reads happened and were merged


def test_a_hit_and_a_release_refresh_a_chain_head_first():
    kv = KVCacheManager(num_blocks=12, block_size=BS, enable_caching=True)
    kv.block_pool.recent = RecentHashes(limit=2)
    a = make_request("a", list(range(13)))  # three full blocks
    computed, cached = kv.get_computed_blocks(a)
    kv.allocate_slots(a, a.num_tokens, computed, cached)
    assert list(kv.block_pool.recent.top) == [a.block_hashes[1], a.block_hashes[0]]  # the head the most recent
    kv.free(a)
    b = make_request("b", list(range(4)) + [60, 61, 62, 63, 64])  # hits a's first block only
    computed, cached = kv.get_computed_blocks(b)
    assert cached == 4
    kv.allocate_slots(b, b.num_tokens - cached, computed, cached)
    assert list(kv.block_pool.recent.top) == [b.block_hashes[1], a.block_hashes[0]]


def test_a_fresh_pool_of_two_million_blocks_keeps_its_summaries_lazily():
    pool = BlockPool(2_000_000, enable_caching=True)
    assert len(pool.states) == 1 and len(pool.recent) == 0 and pool.recent.log_size == 0
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks[1:]))
    assert pool.state_bytes()[:4] == b"ufff" and len(pool.state_bytes()) == 1_999_999


def test_the_engine_reports_changes_after_its_first_report(model_dirs):
    """AsyncLLM.routing_report (what the scheduler actor answers the router): the whole set once,
    then the changes, merged into the same set the whole report names."""
    from engine.async_engine import AsyncLLM
    from engine.sampling_params import SamplingParams
    from tests.engine.test_engine_failures import FakeExecutor, make_core

    core = make_core(model_dirs, FakeExecutor())
    llm = AsyncLLM(core.config, core=core)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def run(tag: str, offset: int) -> None:
        for i in range(3):
            core.add_request(f"{tag}{i}", [1 + (i * 5 + j + offset) % 30 for j in range(10 + 4 * i)], params)
        while core.has_unfinished_requests():
            core.step()

    def reported(payload: dict) -> set[bytes]:
        def keys(raw: bytes) -> set[bytes]:
            return {raw[i:i + 8] for i in range(0, len(raw), 8)}
        return (keys(payload["prefix_hashes"]) - keys(payload["prefix_removed"])) | keys(payload["prefix_added"])

    run("a", 0)
    first = llm.routing_report()
    whole = core.cached_prefix_hashes()
    assert first["prefix_added"] == first["prefix_removed"] == b"" and reported(first) == {
        whole[i:i + 8] for i in range(0, len(whole), 8)} != set()
    run("b", 7)  # other prompts: new hashes
    second = llm.routing_report()
    whole = core.cached_prefix_hashes()
    assert second["prefix_hashes"] == first["prefix_hashes"] and second["prefix_added"] != b""
    assert reported(second) == {whole[i:i + 8] for i in range(0, len(whole), 8)}
    assert llm._prefix_report.num_full_reads == 1
