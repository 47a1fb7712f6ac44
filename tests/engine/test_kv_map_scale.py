"""The readers beside the step loop on a pool of two million blocks (no model): the router's report
and the dashboard's snapshot hold the engine's lock for a bounded time, whatever the pool's size
(before the change log and the pool's state bytes: 0.7 s per report, 0.19 s per snapshot here, see
benchmarks/kv_lock_hold.py), and many viewers cost one snapshot build."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from benchmarks.kv_lock_hold import HELD, TimedLock, churn, filled_scheduler
from engine.kv_map import KVMonitor, rle_decode
from engine.prefix_report import REPORT_LIMIT, PrefixReport

NUM_BLOCKS = 2_000_000
# the holding thread's CPU time under the lock (wall time on this shared 2-core machine also counts
# the other processes' turns); measured: 2 ms for the whole report, 0.02 ms for a step's changes,
# 0.5 ms per snapshot, up to 6.8 ms at a load average of 4.5 (caches shared with the other processes);
# the walks this replaced held it 220-790 ms
MAX_HOLD_S = 0.02


@pytest.fixture(scope="module")
def sched():
    sched = filled_scheduler(NUM_BLOCKS)
    gc.collect()
    gc.freeze()  # two million long-lived blocks: keep the collector's full passes out of the timings
    yield sched
    gc.unfreeze()


def test_the_router_report_holds_the_lock_briefly(sched):
    pool = sched.kv.block_pool
    lock = TimedLock()
    with lock:  # the whole report, as EngineCore.cached_prefix_hashes reads it
        whole = pool.hashes_by_recency(REPORT_LIMIT)
    assert len(whole) == REPORT_LIMIT
    reporter = PrefixReport(pool.recent.read, lock)
    reporter.report()
    for step in range(5):
        churn(sched, step)  # 64 blocks released, 64 taken with new contents
        payload = reporter.report()
        assert reporter.hashes() == {h[:8] for h in pool.recent.top}
        # the base stays; 64 new hashes joined per step, and the 64 least recently used left
        assert len(payload["prefix_hashes"]) == 8 * REPORT_LIMIT
        assert len(payload["prefix_added"]) == len(payload["prefix_removed"]) == 8 * 64 * (step + 1)
    assert reporter.num_full_reads == 1 and len(lock.holds) == 7
    assert max(lock.cpu_holds) < MAX_HOLD_S, lock.cpu_holds
    assert pool.recent.log_size <= 4 * REPORT_LIMIT and len(pool.recent) == REPORT_LIMIT  # memory: O(limit)


def test_a_dashboard_snapshot_holds_the_lock_briefly(sched):
    lock = TimedLock()
    snap = KVMonitor(sched, lock, min_interval_s=0).snapshot()
    assert len(lock.holds) == 1 and lock.cpu_holds[0] < MAX_HOLD_S, lock.cpu_holds
    used = sched.kv.block_pool.num_used_blocks
    assert HELD <= used < HELD + 64  # the last chains, held by the requests
    assert snap["num_blocks"] == NUM_BLOCKS - 1
    assert snap["counts"] == {"free": 0, "cached": NUM_BLOCKS - 1 - used, "used": used, "shared": 0}
    assert len(rle_decode(snap["grid"])) == NUM_BLOCKS - 1


def test_concurrent_viewers_share_one_build_per_interval(sched):
    lock = TimedLock()
    monitor = KVMonitor(sched, lock, min_interval_s=60)
    start = threading.Barrier(8)
    snapshots = []

    def view():
        start.wait()
        snapshots.append(monitor.snapshot())

    threads = [threading.Thread(target=view) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert monitor.num_builds == 1 and len(lock.holds) == 1
    assert all(s["grid_id"] == snapshots[0]["grid_id"] for s in snapshots) and len(snapshots) == 8
    monitor.min_interval_s = 0  # the interval is over: the next poll builds again
    monitor.snapshot()
    assert monitor.num_builds == 2 and len(lock.holds) == 2


def test_a_costly_build_is_reused_for_longer(sched, monkeypatch):
    """A build that took 0.05 s of CPU (and more) is reused ten times as long (builds take at most a tenth of a core),
    not just min_interval_s; with min_interval_s 0 nothing is reused."""
    monitor = KVMonitor(sched, TimedLock(), min_interval_s=0.1)
    build = monitor._pool_snapshot

    def costly():
        started = time.thread_time()
        while time.thread_time() - started < 0.05:
            pass
        return build()

    monkeypatch.setattr(monitor, "_pool_snapshot", costly)
    monitor.snapshot()
    assert monitor.build_s >= 0.05 and monitor.reuse_s == monitor.build_s / 0.1
    time.sleep(0.2)  # past min_interval_s, within ten times the build
    monitor.snapshot()
    assert monitor.num_builds == 1
    monitor.min_interval_s = 0
    assert monitor.reuse_s == 0
    monitor.snapshot()
    assert monitor.num_builds == 2
