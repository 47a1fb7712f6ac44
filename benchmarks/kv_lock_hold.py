"""How long the engine's lock is held by the readers that run beside the step loop, on a large pool.

    python -m benchmarks.kv_lock_hold [--blocks 2000000] [--repeat 5]

Builds a scheduler's block pool of ``--blocks`` blocks (no model), every block made and cached in
chains of 64 blocks, the last 32768 held by 256 running requests and the others freed (a big pool
full of cached prefixes, with a batch running: the state a busy server is in), then times the
engine's lock while it is held by: the router's report on first contact (the whole report; before
the change log, every report), the router's report after a step's worth of changes (64 blocks
released, 64 taken with new contents), and a ``/dashboard/data`` build.
Prints one JSON line per reader: max and median hold in ms.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import threading
import time
from typing import Self

from engine.scheduler import Scheduler

CHAIN = 64  # blocks cached (and freed) together
REQUESTS = 256  # requests holding the last chains
HELD = 32768  # blocks they hold (128 each)
TOKENS = (0,) * 16


class TimedLock:
    """An RLock that records how long each outermost hold lasted: wall seconds in ``holds``, and the
    holding thread's CPU seconds in ``cpu_holds`` (the work done under the lock, whatever else the
    machine is running)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = 0
        self._since = self._cpu_since = 0.0
        self.holds: list[float] = []
        self.cpu_holds: list[float] = []

    def __enter__(self) -> Self:
        self._lock.acquire()
        self._depth += 1
        if self._depth == 1:
            self._since, self._cpu_since = time.perf_counter(), time.thread_time()
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.cpu_holds.append(time.thread_time() - self._cpu_since)
            self.holds.append(time.perf_counter() - self._since)
        self._lock.release()


def block_hash(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def filled_scheduler(num_blocks: int, block_size: int = 16) -> Scheduler:
    """A scheduler whose pool has every block made and cached, in chains of ``CHAIN`` blocks: the
    last ``HELD`` blocks held by ``REQUESTS`` requests in turn, the others freed (tail first)."""
    sched = Scheduler(num_kv_blocks=num_blocks, block_size=block_size, enable_prefix_caching=True,
                      max_num_seqs=REQUESTS, max_num_batched_tokens=8192, max_model_len=num_blocks * block_size)
    kv = sched.kv
    pool = kv.block_pool
    n, i, k = pool.num_usable_blocks, 0, 0
    while i < n:
        chain = pool.get_new_blocks(min(CHAIN, n - i))
        for block in chain:
            pool.cache_block(block, block_hash(i), TOKENS)
            i += 1
        if i <= n - HELD:
            pool.free_blocks(reversed(chain))
        else:
            kv.req_to_blocks.setdefault(f"r{k // 2 % REQUESTS}", []).extend(chain)
        k += 1
    return sched


def churn(sched: Scheduler, step: int) -> None:
    """A step's worth of changes: a request releases its last ``CHAIN`` blocks, another takes as many
    with new contents (evicting the least recently freed)."""
    kv = sched.kv
    pool = kv.block_pool
    tables = list(kv.req_to_blocks.values())
    table = tables[step % len(tables)]
    released, table[-CHAIN:] = table[-CHAIN:], []
    pool.free_blocks(reversed(released))
    chain = pool.get_new_blocks(CHAIN)
    for j, block in enumerate(chain):
        pool.cache_block(block, block_hash(10**12 + step * CHAIN + j), TOKENS)
    tables[(step + 1) % len(tables)].extend(chain)


def measure(num_blocks: int, repeat: int) -> list[dict]:
    t0 = time.perf_counter()
    sched = filled_scheduler(num_blocks)
    built_s = time.perf_counter() - t0
    kv = sched.kv
    results = []

    def timed(name: str, run) -> None:
        lock = TimedLock()
        for step in range(repeat):
            run(lock, step)
        holds_ms, cpu_ms = [h * 1e3 for h in lock.holds], [h * 1e3 for h in lock.cpu_holds]
        results.append({"reader": name, "blocks": num_blocks, "max_hold_ms": round(max(holds_ms), 2),
                        "median_hold_ms": round(statistics.median(holds_ms), 2),
                        "max_hold_cpu_ms": round(max(cpu_ms), 2), "holds": len(holds_ms),
                        "pool_built_s": round(built_s, 1)})

    def full_report(lock, step):
        with lock:  # what EngineCore.cached_prefix_hashes holds (before the change log: every report)
            kv.block_pool.hashes_by_recency(16384)

    timed("router report, whole (cached_prefix_hashes)", full_report)
    if hasattr(kv.block_pool, "recent"):  # the change log (absent before it was introduced)
        from engine.prefix_report import PrefixReport

        def first_contact(lock, step):
            PrefixReport(lambda cursor: kv.block_pool.recent.read(cursor), lock).report()

        timed("router report, first contact (whole set)", first_contact)
        reporter = PrefixReport(lambda cursor: kv.block_pool.recent.read(cursor))
        reporter.report()

        def delta_report(lock_, step):
            churn(sched, step)
            reporter._engine_lock = lock_
            reporter.report()

        timed("router report, changes since the last", delta_report)

    from engine.kv_map import KVMonitor

    def dashboard(lock, step):
        monitor = KVMonitor(sched, lock)
        monitor.snapshot()

    timed("dashboard snapshot", dashboard)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=2_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    for row in measure(args.blocks, args.repeat):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
