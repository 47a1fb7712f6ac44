"""The KV-cache map (engine/kv_map.py) on a scripted, model-free engine: exact counts per state, the
run-length grid and its round trip, the most shared prefixes, the history ring, consistency while
steps run, and its size on a 32768-block pool after churn."""

from __future__ import annotations

import gzip
import json
import random
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.block_hash import hash_blocks
from engine.kv_map import (STATES, KVHistory, KVMonitor, host_tier_usage, most_shared_prefixes, rle_decode,
                           rle_encode)
from engine.request import RequestStatus
from engine.scheduler import Scheduler
from tests.engine.fakes import FakeRunner, make_request

BS = 4
SYSTEM = list(range(1, 13))  # three full blocks


def make_scheduler(num_blocks=40, block_size=BS, caching=True, budget=64, max_num_seqs=16, max_model_len=256):
    return Scheduler(num_kv_blocks=num_blocks, block_size=block_size, enable_prefix_caching=caching,
                     max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len)


def step(sched, runner):
    so = sched.schedule()
    return sched.update_from_output(so, runner.execute_model(so))


def finish_all(sched, runner):
    while sched.has_unfinished_requests():
        step(sched, runner)


def scripted(sched, runner):
    """a (13 tokens) and z (9) run to the end; then b and c hit a's three blocks, and e hits b's four.

    Block ids, from the free queue (1..39 at start; a request frees tail first; a block freed
    without a hash goes to the head, a cached one to the tail):
      a takes 1-4 (1-3 full, cached), frees 4,3,2,1 -> queue 4,5..39,3,2,1
      z takes 4-6 (4, 5 full, cached), frees 6,5,4 -> queue 6,7..39,3,2,1,5,4
      b hits 1-3, takes 6, 7 (6 holds b's tokens 50-53, cached); c hits 1-3, takes 8
      e hits 1-3 and 6, takes 9
    so 1-3 are held by b, c, e; 6 by b and e; 7, 8, 9 by one; 4, 5 cached; 10-39 free."""
    sched.add_request(make_request("a", SYSTEM + [13], max_tokens=2))
    finish_all(sched, runner)
    sched.add_request(make_request("z", list(range(90, 99)), max_tokens=1))
    finish_all(sched, runner)
    sched.add_request(make_request("b", SYSTEM + [50, 51, 52, 53, 54], max_tokens=50))
    sched.add_request(make_request("c", SYSTEM + [60, 61], max_tokens=50))
    step(sched, runner)
    sched.add_request(make_request("e", SYSTEM + [50, 51, 52, 53, 70, 71], max_tokens=50))
    step(sched, runner)


def test_exact_states_counts_and_shared_prefixes_of_a_scripted_engine():
    sched, runner = make_scheduler(), FakeRunner()
    scripted(sched, runner)
    snap = KVMonitor(sched).snapshot()
    assert snap["num_blocks"] == 39 and snap["block_size"] == BS
    assert rle_decode(snap["grid"]) == "sss" + "cc" + "s" + "uuu" + "f" * 30
    assert snap["grid"] == "s3c2su3f30"
    assert snap["counts"] == {"free": 30, "cached": 2, "used": 3, "shared": 4}
    assert snap["num_requests_running"] == 3 and snap["num_requests_waiting"] == 0
    assert snap["kv_cache_usage"] == sched.kv.block_pool.usage == 7 / 39
    # prompt tokens looked up: 13 + 9 + 17 + 14 + 18; hits: 12 (b) + 12 (c) + 16 (e)
    assert (snap["prefix_cache_queries"], snap["prefix_cache_hits"]) == (71, 40)
    assert snap["prefix_cache_hit_rate"] == 40 / 71
    system_hashes = hash_blocks(SYSTEM + [50, 51, 52, 53], BS)
    assert snap["shared_prefixes"] == [
        {"blocks": 3, "tokens": 12, "requests": 3, "hash": system_hashes[2][:4].hex()},  # saves 2 x 3 blocks
        {"blocks": 4, "tokens": 16, "requests": 2, "hash": system_hashes[3][:4].hex()},  # saves 1 x 4
    ]
    assert snap["host_tier"] is None


def test_the_map_follows_the_requests_to_the_end():
    """Once every request has finished, nothing is held: the blocks that were full are cached, the
    rest free, and no prefix is shared."""
    sched, runner = make_scheduler(), FakeRunner()
    scripted(sched, runner)
    finish_all(sched, runner)
    snap = KVMonitor(sched).snapshot()
    pool = sched.kv.block_pool
    assert snap["counts"]["used"] == snap["counts"]["shared"] == 0
    assert snap["counts"]["cached"] == pool.num_cached_blocks > 2
    assert snap["counts"]["free"] == 39 - pool.num_cached_blocks
    assert snap["shared_prefixes"] == [] and snap["kv_cache_usage"] == 0.0
    assert snap["num_requests_running"] == 0


def test_forked_samples_share_their_prompt_even_uncached():
    """n = 2 without prefix caching: the second sample shares the first's full prompt blocks, which
    carry no hash."""
    sched, runner = make_scheduler(caching=False), FakeRunner()
    first = make_request("p#0", list(range(1, 10)), max_tokens=20)
    sched.add_request(first)
    sched.add_request(make_request("p#1", list(range(1, 10)), max_tokens=20, fork_source=first))
    for _ in range(3):
        step(sched, runner)
    snap = KVMonitor(sched).snapshot()
    assert snap["shared_prefixes"] == [{"blocks": 2, "tokens": 8, "requests": 2, "hash": None}]
    assert snap["counts"]["shared"] == 2 and snap["counts"]["cached"] == 0


def test_most_shared_prefixes_keep_the_longest_chain_for_each_holder_count():
    h = {i: bytes([i]) * 16 for i in range(1, 10)}
    chains = [
        [(1, h[1]), (2, h[2]), (3, h[3])],           # x and y share 1-2-3, z shares 1-2
        [(1, h[1]), (2, h[2]), (3, h[3])],
        [(1, h[1]), (2, h[2])],
        [(7, h[7]), (8, h[8])],                      # another prefix, two holders
        [(7, h[7]), (8, h[8])],
        [(9, h[9])],                                 # one holder on this path: not reported
    ]
    assert most_shared_prefixes(chains, block_size=16) == [
        {"blocks": 2, "tokens": 32, "requests": 3, "hash": "02020202"},
        {"blocks": 3, "tokens": 48, "requests": 2, "hash": "03030303"},
        {"blocks": 2, "tokens": 32, "requests": 2, "hash": "08080808"},
    ]
    assert len(most_shared_prefixes(chains, block_size=16, limit=1)) == 1


# --- the run-length grid -------------------------------------------------------------------------------


def test_rle_examples_and_refusals():
    assert rle_encode("") == "" and rle_decode("") == ""
    assert rle_encode("ffffcuss") == "f4cus2"
    assert rle_encode("f" * 32768) == "f32768"
    for bad in ("x", "f0", "f01", "4f", "ff2 ", "F3"):
        with pytest.raises(ValueError, match="not a run-length encoded block map"):
            rle_decode(bad)
    with pytest.raises(ValueError, match="block states must be letters among f, c, u, s"):
        rle_encode("fxu")


@given(st.lists(st.tuples(st.sampled_from("fcus"), st.integers(1, 40)), max_size=60))
def test_rle_round_trip(runs):
    states = "".join(code * n for code, n in runs)
    encoded = rle_encode(states)
    assert rle_decode(encoded) == states
    assert len(encoded) <= len(states)


# --- history ---------------------------------------------------------------------------------------


def test_the_hit_rate_of_each_sample_covers_the_last_window():
    history = KVHistory(capacity=4, window_s=10.0)
    history.record(0.0, 0.0, 0, 0, 0, 0)
    history.record(1.0, 0.25, 10, 5, 1, 2)      # 5 of 10 since t=0
    history.record(5.0, 0.5, 10, 5, 1, 0)       # still the same 10 looked up within 10 s
    history.record(12.0, 0.5, 10, 5, 0, 0)      # base t=1: nothing looked up since
    history.record(13.0, 0.75, 30, 25, 2, 0)    # base t=1: 20 of 20
    assert len(history) == 4  # the ring dropped t=0
    assert history.columns() == {"t": [1.0, 5.0, 12.0, 13.0], "kv_usage": [0.25, 0.5, 0.5, 0.75],
                                 "hit_rate": [0.5, 0.5, None, 1.0], "running": [1, 1, 0, 2],
                                 "waiting": [2, 0, 0, 0], "host_usage": [None] * 4}
    assert history.columns(since=5.0)["t"] == [12.0, 13.0]
    assert history.columns(since=13.0)["t"] == []


def test_the_monitor_samples_the_engine_and_serves_history_since_a_time():
    clock = iter(range(100, 200))
    sched, runner = make_scheduler(), FakeRunner()
    monitor = KVMonitor(sched, clock=lambda: float(next(clock)))
    monitor.sample()  # t=100, nothing yet
    sched.add_request(make_request("a", SYSTEM + [13], max_tokens=2))
    step(sched, runner)
    monitor.sample()  # t=101: a runs on 4 of 39 blocks, 13 tokens looked up, no hit
    finish_all(sched, runner)
    sched.add_request(make_request("b", SYSTEM + [14], max_tokens=2))
    step(sched, runner)
    monitor.sample()  # t=102: b hits a's 12 tokens of its 13
    snap = monitor.snapshot()
    assert snap["history"] == {"period_s": 1.0, "window_s": 10.0, "t": [100.0, 101.0, 102.0],
                               "kv_usage": [0.0, round(4 / 39, 4), round(4 / 39, 4)],
                               "hit_rate": [None, 0.0, round(12 / 26, 4)], "running": [0, 1, 1],
                               "waiting": [0, 0, 0], "host_usage": [None] * 3}
    assert monitor.snapshot(since=101.0)["history"]["t"] == [102.0]


def test_the_sampler_thread_samples_until_stopped():
    sched = make_scheduler()
    monitor = KVMonitor(sched, threading.RLock(), period_s=0.02).start()
    try:
        deadline = threading.Event()
        for _ in range(200):
            if len(monitor.history) >= 4:
                break
            deadline.wait(0.02)
    finally:
        monitor.stop()
    taken = len(monitor.history)
    assert taken >= 4
    threading.Event().wait(0.1)
    assert len(monitor.history) == taken  # stopped: no more samples


def test_host_tier_usage_is_read_from_the_tier():
    from engine.host_tier import HostTierIndex

    tier = HostTierIndex(8)
    for i in range(3):
        tier.insert(bytes([i]) * 16, (i, i, i, i))
    assert host_tier_usage(tier) == {"num_blocks": 8, "num_used": 3}
    assert host_tier_usage(None) is None
    sched = make_scheduler()
    sched.kv.host_tier = tier
    monitor = KVMonitor(sched)
    monitor.sample()
    snap = monitor.snapshot()
    assert snap["host_tier"] == {"num_blocks": 8, "num_used": 3}
    assert snap["history"]["host_usage"] == [3 / 8]


def test_an_engine_with_a_host_tier_shows_what_it_offloaded():
    """Seven prompts of 9 tokens (2 full blocks each, 3 blocks with their 2 outputs) one after the other
    in 11 usable blocks, each taking the last one's partial block (blank) and two more: r0-r4 fill the
    pool, r5 evicts r0's two cached blocks, r6 r1's two: four blocks offloaded into the tier of 8."""
    sched = Scheduler(num_kv_blocks=12, block_size=BS, enable_prefix_caching=True, max_num_seqs=4,
                      max_num_batched_tokens=64, max_model_len=64, num_host_kv_blocks=8)
    runner = FakeRunner()
    for i in range(7):
        sched.add_request(make_request(f"r{i}", [10 * i + j for j in range(1, 10)], max_tokens=2))
        finish_all(sched, runner)
    monitor = KVMonitor(sched)
    monitor.sample()
    snap = monitor.snapshot()
    stats = sched.kv.host_tier_stats()
    assert snap["host_tier"] == {"num_blocks": 8, "num_used": 4}
    assert (stats["host_kv_cache_blocks"], stats["host_kv_cache_blocks_used"]) == (8, 4)
    assert snap["history"]["host_usage"] == [0.5]


# --- consistency and size --------------------------------------------------------------------------------


def test_every_snapshot_is_whole_while_steps_run():
    """A thread steps a busy scheduler under the lock; every snapshot taken meanwhile holds together:
    its grid decodes to its counts, its usage is its held blocks' share, every shared prefix is held
    by at most the running requests."""
    sched, runner = make_scheduler(num_blocks=120, budget=24), FakeRunner()
    lock = threading.RLock()
    rng = random.Random(3)
    stop = threading.Event()

    def drive():
        n = 0
        while not stop.is_set():
            with lock:
                if len(sched.waiting) < 4:
                    prefix = SYSTEM if rng.random() < 0.7 else [rng.randrange(1, 40) for _ in range(12)]
                    sched.add_request(make_request(f"r{n}", prefix + [rng.randrange(1, 40) for _ in range(rng.randrange(1, 9))],
                                                   max_tokens=rng.randrange(1, 12)))
                    n += 1
                step(sched, runner)

    driver = threading.Thread(target=drive)
    driver.start()
    try:
        monitor = KVMonitor(sched, lock)
        shared_seen = 0
        for _ in range(150):
            snap = monitor.snapshot()
            states = rle_decode(snap["grid"])
            assert len(states) == snap["num_blocks"] == 119
            assert {name: states.count(code) for code, name in STATES.items()} == snap["counts"]
            held = snap["counts"]["used"] + snap["counts"]["shared"]
            assert snap["kv_cache_usage"] == held / 119
            assert all(2 <= p["requests"] <= snap["num_requests_running"] for p in snap["shared_prefixes"])
            shared_seen += snap["counts"]["shared"] > 0
    finally:
        stop.set()
        driver.join()
    assert shared_seen > 0


def test_a_fragmented_32768_block_pool_stays_small_on_the_wire():
    """After churn (requests of many lengths, a third sharing a system prompt, finishing at random),
    one replica's snapshot is a few KB gzip-compressed, as the data endpoint sends it."""
    sched, runner = make_scheduler(num_blocks=32768, block_size=16, budget=8192, max_num_seqs=256,
                                   max_model_len=4096), FakeRunner()
    rng = random.Random(7)
    system = [rng.randrange(1, 50) for _ in range(160)]
    for i in range(1500):
        if len(sched.waiting) < 64:
            prompt = ([*system] if rng.random() < 0.33 else []) + [rng.randrange(1, 50) for _ in range(rng.randrange(8, 400))]
            sched.add_request(make_request(f"r{i}", prompt, block_size=16, max_tokens=rng.randrange(1, 400)))
        step(sched, runner)
    # a third of the running requests aborted: their last, partial blocks go back blank (free)
    sched.finish_requests([r.request_id for r in sched.running[::3]], RequestStatus.FINISHED_ABORTED)
    snap = KVMonitor(sched).snapshot()
    runs = len([c for c in snap["grid"] if c.isalpha()])
    assert runs > 1500, runs  # fragmented: 2107 runs on this seed
    counts = snap["counts"]
    assert counts["used"] > 1000 and counts["cached"] > 1000 and counts["free"] > 20 and counts["shared"] >= 10, counts  # free: 66
    wire = gzip.compress(json.dumps(snap, separators=(",", ":")).encode(), compresslevel=6)
    assert len(wire) < 6_000, len(wire)  # about 3 KB: 2 KB/s at the page's 1.5 s poll
