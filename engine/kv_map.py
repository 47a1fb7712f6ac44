"""A live map of the KV block pool: what the dashboard (``/dashboard``) draws for each engine.

Every usable block (ids 1 .. num_blocks - 1; block 0 is the null block) is in one state, read from
the pool's reference counts and hashes:

    f  free      no holder, no cached contents
    c  cached    no holder, still in the prefix cache: a later prompt can hit it (evicted first in
                 the free queue's order)
    u  used      held by one request
    s  shared    held by several requests (prefix hits, n > 1 samples)

The states travel run-length encoded (``rle_encode``: the state letter, then the run's length when
it is more than one): a pool of 32768 blocks is a few hundred bytes when it is calm, and no more
than a few KB compressed when churn has fragmented it.

``KVMonitor`` takes snapshots under the engine's lock (the way ``stats()`` and the router's hash
report read the pool: never while a step changes it). The pool keeps its blocks' states as it
changes (``BlockPool.states``, a byte per block), so the lock is held for a copy of those bytes and
a walk over the shared leading blocks of the block tables, never for a pass over the pool: the
encoding, counting and hashing happen after the lock is released. A snapshot is reused for
``min_interval_s``, or for ten times as long as it took to build if that is longer (a fragmented pool
of millions of blocks takes a third of a second to encode, under the interpreter's lock the step
loop needs too: its builds then take at most a tenth of a core), and callers that arrive while one
is built wait for it, so any number of viewers costs one build per interval. The monitor also keeps a ring of samples taken about once a
second (KV usage, prefix-cache hit rate over the last ``window_s``, running and waiting requests),
so a viewer that arrives sees the last minutes. The most shared prefixes come from the requests'
block tables: sharing always starts at a table's first block (a hit or a fork shares a prefix), so
each table is walked only while its blocks have more than one holder.

The second tier in host memory, where the engine has one (``scheduler.kv.host_tier``), is reported
as its capacity and the blocks it holds.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Iterable
from contextlib import nullcontext

logger = logging.getLogger(__name__)

FREE, CACHED, USED, SHARED = "f", "c", "u", "s"
STATES = {FREE: "free", CACHED: "cached", USED: "used", SHARED: "shared"}  # code -> name in "counts"
SAMPLE_PERIOD_S = 1.0
SNAPSHOT_INTERVAL_S = 1.0  # a pool snapshot is reused for this long (the page polls every 1.5 s) ...
BUILD_SHARE = 0.1  # ... or longer, so that building snapshots takes at most this share of a core
HISTORY_SAMPLES = 300  # five minutes at one sample a second
HIT_RATE_WINDOW_S = 10.0
MAX_SHARED_PREFIXES = 10

_STATES_TEXT = re.compile(r"[fcus]*")
_RUN = re.compile(r"f+|c+|u+|s+")
_ENCODED_RUN = re.compile(r"([fcus])([1-9][0-9]*)?")


def block_states(blocks: list) -> str:
    """One state letter per block of ``blocks`` (the pool's blocks without the null block)."""
    return "".join(["s" if b.ref_cnt > 1 else "u" if b.ref_cnt else "f" if b.block_hash is None else "c"
                    for b in blocks])


def rle_encode(states: str) -> str:
    """``"ffffcuss"`` -> ``"f4cus2"``: each run as its letter, then its length when above one."""
    if not _STATES_TEXT.fullmatch(states):
        raise ValueError("block states must be letters among f, c, u, s")
    runs = []
    for match in _RUN.finditer(states):
        n = match.end() - match.start()
        runs.append(match.group()[0] if n == 1 else f"{match.group()[0]}{n}")
    return "".join(runs)


def rle_decode(encoded: str) -> str:
    """The inverse of ``rle_encode``; ValueError for text it cannot have written."""
    out, pos = [], 0
    for match in _ENCODED_RUN.finditer(encoded):
        if match.start() != pos:
            break
        out.append(match.group(1) * int(match.group(2) or 1))
        pos = match.end()
    if pos != len(encoded):
        raise ValueError(f"not a run-length encoded block map at character {pos}: {encoded[pos:pos + 10]!r}")
    return "".join(out)


def shared_chains(tables: Iterable[list]) -> list[list[tuple[int, bytes | None]]]:
    """(block id, hash) of the leading blocks of each table that more than one request holds."""
    chains = []
    for table in [t for t in tables if t and t[0].ref_cnt > 1]:  # sharing starts at the first block
        n = 0
        for block in table:
            if block.ref_cnt < 2:
                break
            n += 1
        if n:
            chains.append([(b.block_id, b.block_hash) for b in table[:n]])
    return chains


class _Node:
    __slots__ = ("children", "count", "depth", "block_hash")

    def __init__(self, depth: int, block_hash: bytes | None) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0
        self.depth = depth
        self.block_hash = block_hash


def most_shared_prefixes(chains: list[list[tuple[int, bytes | None]]], block_size: int,
                         limit: int = MAX_SHARED_PREFIXES) -> list[dict]:
    """The prefixes that several requests hold, longest for each number of holders: a trie over the
    chains of block ids, reporting a node held by two or more requests where no longer chain is held
    by as many. Most blocks saved first ((requests - 1) x blocks), then longest.

    Each entry: ``blocks``, ``tokens`` (blocks x block_size), ``requests``, ``hash`` (the first 8 hex
    digits of the last block's chained hash, which names the whole prefix; null if not cached)."""
    root = _Node(0, None)
    for chain in chains:
        node = root
        for block_id, block_hash in chain:
            child = node.children.get(block_id)
            if child is None:
                child = node.children[block_id] = _Node(node.depth + 1, block_hash)
            child.count += 1
            node = child
    found = []
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node.count >= 2 and all(c.count < node.count for c in node.children.values()):
            found.append({"blocks": node.depth, "tokens": node.depth * block_size, "requests": node.count,
                          "hash": node.block_hash[:4].hex() if node.block_hash is not None else None})
    found.sort(key=lambda p: (-(p["requests"] - 1) * p["blocks"], -p["blocks"], -p["requests"], p["hash"] or ""))
    return found[:limit]


def host_tier_of(scheduler):
    """The engine's host-memory KV tier, where it has one."""
    kv = getattr(scheduler, "kv", None)
    return getattr(kv, "host_tier", None) or getattr(scheduler, "host_tier", None)


def host_tier_usage(tier) -> dict | None:
    """{"num_blocks": capacity, "num_used": resident blocks} of a host tier, or None without one.
    Read by name: capacity ``num_slots`` (or ``num_blocks``), use ``num_resident`` (or
    ``num_used_blocks``, or ``len()``)."""
    if tier is None:
        return None
    capacity = next((getattr(tier, n) for n in ("num_slots", "num_blocks") if hasattr(tier, n)), None)
    used = next((getattr(tier, n) for n in ("num_resident", "num_used_blocks") if hasattr(tier, n)), None)
    if used is None and hasattr(tier, "__len__"):
        used = len(tier)
    if capacity is None or used is None:
        return None
    return {"num_blocks": int(capacity), "num_used": int(used)}


class KVHistory:
    """A ring of samples (time, KV usage, windowed hit rate, running, waiting, host-tier usage),
    oldest first."""

    def __init__(self, capacity: int = HISTORY_SAMPLES, window_s: float = HIT_RATE_WINDOW_S) -> None:
        self.window_s = window_s
        # (t, usage, hit rate or None, running, waiting, host-tier usage or None)
        self._samples: deque[tuple] = deque(maxlen=capacity)
        self._counters: deque[tuple[float, int, int]] = deque()  # (t, queries, hits) within the window

    def record(self, t: float, usage: float, queries: int, hits: int, running: int, waiting: int,
               host_usage: float | None = None) -> None:
        """One sample. The hit rate is that of the prompt tokens looked up in the last ``window_s``
        (None when none were), from the cumulative ``queries`` and ``hits``; ``host_usage`` the host
        tier's share in use (None without a tier)."""
        counters = self._counters
        while len(counters) > 1 and counters[1][0] <= t - self.window_s:
            counters.popleft()  # the base is the latest sample at least window_s old (else the oldest)
        base = counters[0] if counters else (t, queries, hits)
        counters.append((t, queries, hits))
        d_queries, d_hits = queries - base[1], hits - base[2]
        rate = d_hits / d_queries if d_queries > 0 else None
        self._samples.append((t, usage, rate, running, waiting, host_usage))

    def __len__(self) -> int:
        return len(self._samples)

    def columns(self, since: float | None = None) -> dict:
        """The samples taken after ``since`` (all without), as columns."""
        rows = [s for s in self._samples if since is None or s[0] > since]
        return {
            "t": [round(r[0], 2) for r in rows],
            "kv_usage": [round(r[1], 4) for r in rows],
            "hit_rate": [None if r[2] is None else round(r[2], 4) for r in rows],
            "running": [r[3] for r in rows],
            "waiting": [r[4] for r in rows],
            "host_usage": [None if r[5] is None else round(r[5], 4) for r in rows],
        }


class KVMonitor:
    """Snapshots of one engine's block pool for the dashboard, and the history behind its charts.

    ``scheduler``: the engine's Scheduler; ``lock``: the lock the engine holds while a step changes
    the scheduler (``EngineCore.lock``). ``start()`` samples the history every ``period_s`` on a
    daemon thread until ``stop()``; ``sample()`` takes one sample now. ``min_interval_s``: how long a
    pool snapshot is reused at least (0: never reused)."""

    def __init__(self, scheduler, lock=None, *, period_s: float = SAMPLE_PERIOD_S,
                 capacity: int = HISTORY_SAMPLES, window_s: float = HIT_RATE_WINDOW_S,
                 clock=time.time, min_interval_s: float = SNAPSHOT_INTERVAL_S) -> None:
        self.scheduler = scheduler
        self.lock = lock if lock is not None else nullcontext()
        self.period_s = period_s
        self.clock = clock
        self.history = KVHistory(capacity, window_s)
        self._history_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.min_interval_s = min_interval_s
        self.num_builds = 0  # pool snapshots built (the others were reused)
        self._build_lock = threading.Lock()
        self._pool: dict | None = None
        self._pool_built_at = 0.0  # time.monotonic() when the reused snapshot was built
        self.build_s = 0.0  # how long the last build took (thread CPU time)

    # --- sampling --------------------------------------------------------------------------------

    def sample(self) -> None:
        sched = self.scheduler
        with self.lock:
            stats = sched.stats
            tier = host_tier_usage(host_tier_of(sched))
            values = (sched.kv.block_pool.usage, stats.prefix_cache_queries, stats.prefix_cache_hits,
                      len(sched.running), len(sched.waiting),
                      tier["num_used"] / tier["num_blocks"] if tier and tier["num_blocks"] else None)
        with self._history_lock:
            self.history.record(self.clock(), *values)

    def start(self) -> KVMonitor:
        if self._thread is None:
            self._stop.clear()
            self.sample()
            self._thread = threading.Thread(target=self._run, name="kvserve-kv-map", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a failed sample leaves a gap, never a dead sampler
                logger.exception("sampling the KV map failed")

    # --- snapshots -------------------------------------------------------------------------------

    def snapshot(self, since: float | None = None) -> dict:
        """The pool (as of at most ``reuse_s`` ago) and the history samples taken after
        ``since`` (all of them without). A build holds the engine's lock for a copy of the pool's
        state bytes (a byte per block) and the walk over the shared leading blocks of the tables."""
        with self._build_lock:  # callers arriving during a build wait for it, then share it
            if self._pool is None or time.monotonic() - self._pool_built_at >= self.reuse_s:
                started = time.thread_time()
                self._pool = self._pool_snapshot()
                self._pool_built_at = time.monotonic()
                self.build_s = time.thread_time() - started
                self.num_builds += 1
            pool = self._pool
        with self._history_lock:
            history = self.history.columns(since)
        return {**pool, "history": {"period_s": self.period_s, "window_s": self.history.window_s, **history}}

    @property
    def reuse_s(self) -> float:
        """How long the last snapshot is reused: ``min_interval_s``, longer for a costly build."""
        return self.min_interval_s and max(self.min_interval_s, self.build_s / BUILD_SHARE)

    def _pool_snapshot(self) -> dict:
        sched = self.scheduler
        kv = sched.kv
        pool = kv.block_pool
        with self.lock:  # a consistent picture: no step changes the pool meanwhile
            t = self.clock()
            state_bytes = pool.state_bytes()  # a copy: no pass over the blocks
            chains = shared_chains(kv.req_to_blocks.values())
            stats = sched.stats
            running, waiting = len(sched.running), len(sched.waiting)
            queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
            usage = pool.usage
            tier = host_tier_usage(host_tier_of(sched))
        states = state_bytes.decode("ascii")
        grid = rle_encode(states)
        counts = {name: state_bytes.count(code.encode()) for code, name in STATES.items()}
        return {
            "time": round(t, 3),
            "block_size": kv.block_size,
            "num_blocks": len(states),
            "counts": counts,
            "grid": grid,
            "grid_id": hashlib.blake2b(grid.encode(), digest_size=6).hexdigest(),
            "num_requests_running": running,
            "num_requests_waiting": waiting,
            "kv_cache_usage": usage,
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "host_tier": tier,
            "shared_prefixes": most_shared_prefixes(chains, kv.block_size),
        }
