"""`kvserve soak`: the Serve app (started as `kvserve chaos` starts it) under the load of
benchmarks/chaos.py for N minutes, then: the RSS of every process of the cluster after a warm-up and
at the end (growth per process), the errors, and the KV blocks the engine holds once the load
stopped (the scheduler actor's stats())."""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections import Counter

from benchmarks.mixed_load import MixedLoad
from benchmarks.chaos import (Load, _outcomes, _settled_stats, _write, add_common_arguments, app_args, engine_stats,
                              start_app, stop_app)
from benchmarks.server_process import with_descendants


TIMELINE_S = 30.0


def add_soak_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds of load before the RSS baseline (default: 10%% of the run, at most 60)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--load", choices=("mixed", "completions"), default="mixed",
                        help="mixed (default): completions and chat, unary and streamed, a fifth of the streams "
                        "cut after their first chunk (benchmarks/mixed_load.py); completions: chaos's load")


def _processes(root: int) -> dict[int, str]:
    """pid -> name of every live process under ``root`` (Linux /proc): Ray's GCS, raylet, and the
    workers it starts (Serve's controller and proxy, the replicas, the scheduler actor, the ranks)."""
    found = {pid: _name(pid) for pid in with_descendants([root]) if pid != root}
    return {pid: name for pid, name in found.items() if name}


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return ""
    first = argv[0].decode(errors="replace").strip()
    if first.startswith("ray::"):  # a worker: its title names the actor (and the method it runs)
        return first.split(" ")[0].split(".")[0]
    script = next((a.decode(errors="replace") for a in argv[1:] if a.endswith(b".py")), None)
    return os.path.basename(first) + (f" {os.path.basename(script)}" if script else "")


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def rss_snapshot() -> dict[int, tuple[str, float]]:
    snapshot = {}
    for pid, name in _processes(os.getpid()).items():
        rss = _rss_mb(pid)
        if rss is not None:
            snapshot[pid] = (name, rss)
    return snapshot


async def _soak(url: str, seconds: float, warmup: float, concurrency: int, max_tokens: int,
                timeout: float, kind: str = "mixed") -> tuple[Load, dict, dict, list, int | None]:
    load = (MixedLoad if kind == "mixed" else Load)(url, concurrency, max_tokens, timeout)
    load.start()
    try:
        await asyncio.sleep(warmup)
        made = (await asyncio.get_running_loop().run_in_executor(None, engine_stats)).get("num_blocks_made")
        baseline = rss_snapshot()
        timeline = [(0.0, baseline)]  # every TIMELINE_S: whether a growth levels off or keeps on
        start = time.monotonic()
        while (left := seconds - (time.monotonic() - start)) > 0:
            await asyncio.sleep(min(TIMELINE_S, left))
            timeline.append((time.monotonic() - start, rss_snapshot()))
        end = timeline[-1][1]
    finally:
        await load.stop()
    return load, baseline, end, timeline, made


def run_soak(model: str | None = None, minutes: float = 10.0, warmup: float | None = None, concurrency: int = 4,
             max_tokens: int = 16, timeout: float = 60.0, tensor_parallel_size: int = 1, load_kind: str = "mixed",
             **app_args) -> dict:
    seconds = minutes * 60
    warmup = min(60.0, 0.1 * seconds) if warmup is None else warmup
    url = start_app(model, tensor_parallel_size, **app_args)
    try:
        print(f"[soak] {warmup:.0f}s of warm-up, then {seconds:.0f}s of load at concurrency {concurrency}", flush=True)
        load, baseline, end, timeline, made_at_start = asyncio.run(
            _soak(url, seconds, warmup, concurrency, max_tokens, timeout, load_kind))
        stats = _settled_stats()
    finally:
        stop_app()
    processes = []
    for pid, (name, rss) in sorted(baseline.items()):
        if pid in end:
            processes.append({"pid": pid, "name": name, "rss_start_mb": round(rss, 1),
                              "rss_end_mb": round(end[pid][1], 1), "growth_mb": round(end[pid][1] - rss, 1),
                              "rss_timeline_mb": [[round(t), round(snap[pid][1], 1)] for t, snap in timeline
                                                  if pid in snap]})
    measured = [r for r in load.records if r.start >= load.records[0].start + warmup] if load.records else []
    report = {
        "minutes": minutes, "load": load_kind, "warmup_s": warmup, "concurrency": concurrency, "max_tokens": max_tokens,
        "tensor_parallel_size": tensor_parallel_size,
        "requests": len(load.records), "requests_ok": sum(r.ok for r in load.records),
        "errors": sum(not r.ok for r in load.records), "outcomes": _outcomes(load.records),
        "ok_by_kind": dict(Counter(r.code or ("stream" if r.stream else "unary") for r in load.records if r.ok)),
        "requests_per_s": round(len(measured) / seconds, 2) if seconds else None,
        "processes": processes,
        "max_growth_mb": max((p["growth_mb"] for p in processes), default=None),
        "total_growth_mb": round(sum(p["growth_mb"] for p in processes), 1),
        "processes_started_meanwhile": sorted({n for pid, (n, _) in end.items() if pid not in baseline}),
        "processes_gone_meanwhile": sorted({n for pid, (n, _) in baseline.items() if pid not in end}),
        "num_blocks_in_use_at_end": stats["num_blocks_in_use"],
        "num_cached_blocks_at_end": stats["num_cached_blocks"],
        "num_requests_running_at_end": stats["num_requests_running"],
        "num_kv_blocks": stats["num_kv_blocks"],
        # KV block objects the pool made during the measured part: its first fill (each id's block and
        # prefix-cache entry, ~0.6 KB, made on first use) grows the scheduler actor until every id was used
        "num_blocks_made_start": made_at_start,
        "num_blocks_made_end": stats.get("num_blocks_made"),
    }
    for p in processes:
        print(f"[soak] {p['name']:<48} pid {p['pid']:>7}  {p['rss_start_mb']:8.1f} -> {p['rss_end_mb']:8.1f} MB "
              f"({p['growth_mb']:+.1f})", flush=True)
    print(f"[soak] {report['requests_ok']} of {report['requests']} requests ok, errors {report['outcomes']}; "
          f"KV blocks in use at the end {report['num_blocks_in_use_at_end']}; largest RSS growth "
          f"{report['max_growth_mb']} MB; KV blocks made {made_at_start} -> {report['num_blocks_made_end']} of "
          f"{report['num_kv_blocks']} (the pool's first fill)", flush=True)
    return report


def run_soak_command(args: argparse.Namespace) -> int:
    report = run_soak(args.model, args.minutes, args.warmup, args.concurrency, args.max_tokens, args.timeout,
                      args.tensor_parallel_size, args.load, **app_args(args.app_arg))
    _write(report, args.out)
    return 0
