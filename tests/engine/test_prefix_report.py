"""The routing report of the prefix cache: hashes by recency of use (a hit refreshes a block), and a
consistent snapshot when read from another thread than the step loop."""

from __future__ import annotations

import threading

from engine import SamplingParams
from engine.block_hash import hash_blocks
from engine.kv_cache_manager import KVCacheManager
from tests.engine.fakes import make_request
from tests.engine.test_engine_failures import FakeExecutor, make_core
from tests.engine.test_kv_cache_manager import run_prefill

BS = 4
SYSTEM = list(range(1, 13))  # three full blocks


def entries(digest: bytes) -> list[bytes]:
    return [digest[i:i + 8] for i in range(0, len(digest), 8)]


def short(hashes) -> list[bytes]:
    return [h[:8] for h in hashes]


def test_a_hit_brings_an_early_prefix_back_to_the_front():
    kv = KVCacheManager(num_blocks=40, block_size=BS, enable_caching=True)
    system = make_request("s", SYSTEM + [99])
    run_prefill(kv, system)
    kv.free(system)
    others = []
    for i in range(6):  # later prompts, each cached after the system prompt
        other = make_request(f"o{i}", [100 + 10 * i + j for j in range(8)] + [7])
        run_prefill(kv, other)
        kv.free(other)
        others.append(other)
    system_hashes = short(hash_blocks(SYSTEM, BS))
    # by recency of use: the latest freed first; a request frees its tail first, so its first block
    # is its most recent. The system prompt, used first and never since, comes last.
    by_recency = [h for other in reversed(others) for h in short(other.block_hashes)] + system_hashes
    assert entries(kv.cached_hash_digest(100)) == by_recency
    assert entries(kv.cached_hash_digest(12)) == by_recency[:12]  # the system prompt is out
    # a new request hits the system prompt: its blocks are in use, the most recently used
    again = make_request("s2", SYSTEM + [50, 51])
    assert run_prefill(kv, again) == 12
    assert entries(kv.cached_hash_digest(3)) == system_hashes
    kv.free(again)  # and stay the most recent once freed
    assert entries(kv.cached_hash_digest(100)) == system_hashes + by_recency[:12]


def test_duplicates_are_reported_once():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    for rid in ("a", "b"):  # two copies of the last block (the hit stops one token short)
        run_prefill(kv, make_request(rid, list(range(8))))
    assert kv.block_pool.num_cached_blocks == 3
    assert entries(kv.cached_hash_digest(10)) == short(hash_blocks(list(range(8)), BS))


def test_the_report_is_read_whole_while_steps_run(model_dirs):
    core = make_core(model_dirs, FakeExecutor())
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    errors, snapshots = [], []
    done = threading.Event()

    def read():
        while not done.is_set():
            try:
                snapshots.append(entries(core.cached_prefix_hashes(64)))
                core.stats()
            except Exception as exc:  # noqa: BLE001 - what the test looks for
                errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for round_ in range(12):
            for i in range(4):
                core.add_request(f"r{round_}-{i}", [1 + (round_ * 7 + i * 3 + j) % 40 for j in range(9 + i)],
                                 params)
            while core.has_unfinished_requests():
                core.step()
    finally:
        done.set()
        reader.join()
    assert not errors
    assert len(snapshots) > 1 and all(len(s) == len(set(s)) <= 64 for s in snapshots)
    final = entries(core.cached_prefix_hashes(64))
    assert len(final) == min(64, len(core.scheduler.kv.block_pool.cached))
