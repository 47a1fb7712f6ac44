"""`python -m benchmarks.gemm_peak`: the packed matrix product (kernels/cpu/gemm.cpp) against this
CPU's multiply-add peak.

The peak is a compiled loop of independent multiply-add chains on the kernels' vectors
(``kvserve_cpu::fma_peak``), timed on each thread's own CPU clock: GFLOP/s per core, and the total
of the threads of torch's pool run together. Then, for weights of real models (K inputs x N outputs:
Qwen2-0.5B's gate/up, down and qkv, a Llama-ish MLP, a square 4096, and the four products of this
project's Qwen3 ``small`` preset, which the offline benchmark runs) and batches of M rows, the
packed product (``kvserve_cpu::linear`` on a weight packed by ``pack_linear_weight``, the engine's
layout) and torch's ``F.linear`` (MKL / oneDNN) on the unpacked weight, at 1 and 2 threads.

Every time is the best of ``--repeats`` runs on the wall clock; at one thread the product is also
timed on the thread's CPU clock (``cpu``), which leaves out the time the thread was descheduled: on
a machine others are using it is the figure to read against the peak (at two threads the idle
worker's spinning between calls makes the process's CPU clock useless, and only the wall clock is
given). ``of peak``: GFLOP/s / (per-core peak x threads).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.op_report import comma_ints, emit

ROWS = (1, 8, 64, 256, 512, 1024, 2048)
# (K, N): inputs x outputs of a linear layer
SHAPES = {
    (896, 4864): "Qwen2-0.5B gate/up",
    (4864, 896): "Qwen2-0.5B down",
    (896, 1152): "Qwen2-0.5B qkv",
    (2048, 5632): "Llama-ish gate/up",
    (4096, 4096): "4096 square",
    (512, 1536): "Qwen3 small qkv",
    (1024, 512): "Qwen3 small o",
    (512, 2816): "Qwen3 small gate/up",
    (1408, 512): "Qwen3 small down",
}
TARGET = 0.75  # the bar for large products: 75% of the measured peak x threads


def _ops():
    from kernels.cpu import load, load_error

    ops = load()
    if ops is None:
        raise SystemExit(f"the compiled CPU kernels are not available here: {load_error()}")
    return ops


def fma_peak(ops, threads: int, repeats: int = 20, iterations: int = 200_000) -> float:
    """GFLOP/s of multiply-adds, the best of ``repeats``: one thread's, or (threads > 1) the total of
    torch's ``threads`` threads run together."""
    torch.set_num_threads(threads)
    return max(float(ops.fma_peak(iterations, threads > 1)) for _ in range(repeats))


def _best(fn, repeats: int, min_seconds: float = 0.02) -> tuple[float, float]:
    """(wall seconds, thread CPU seconds) per call of fn, each the best of ``repeats`` runs of enough
    calls to take min_seconds."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    calls = max(1, math.ceil(min_seconds / once))
    wall = cpu = math.inf
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(calls):
            fn()
        wall = min(wall, (time.perf_counter() - w0) / calls)
        cpu = min(cpu, (time.thread_time() - c0) / calls)
    return wall, cpu


def measure(rows=ROWS, shapes=tuple(SHAPES), threads=(1, 2), repeats: int = 5, torch_too: bool = True,
            seed: int = 0) -> dict:
    ops = _ops()
    panel = int(ops.linear_panel_width())
    previous = torch.get_num_threads()
    gen = torch.Generator().manual_seed(seed)
    result: dict = {"panel_width": panel, "peak_per_core": fma_peak(ops, 1), "peak": {}, "products": []}
    try:
        for t in threads:
            result["peak"][t] = fma_peak(ops, t)
        for k, n in shapes:
            weight = torch.empty(n, k).uniform_(-1.0, 1.0, generator=gen) / math.sqrt(k)
            packed = torch.empty(n // panel, k, panel)
            ops.pack_linear_weight(weight, packed)
            for m in rows:
                x = torch.randn(m, k, generator=gen)
                flops = 2.0 * m * k * n
                for t in threads:
                    torch.set_num_threads(t)
                    wall, cpu = _best(lambda x=x, packed=packed: ops.linear(x, packed, None), repeats)
                    row = {"k": k, "n": n, "m": m, "threads": t, "packed_gflops": flops / wall / 1e9,
                           "packed_cpu_gflops": flops / cpu / 1e9 if t == 1 else None}
                    if torch_too:
                        twall, _ = _best(lambda x=x, weight=weight: F.linear(x, weight), repeats)
                        row["torch_gflops"] = flops / twall / 1e9
                    peak = result["peak_per_core"] * t
                    row["of_peak"] = row["packed_gflops"] / peak
                    row["cpu_of_peak"] = row["packed_cpu_gflops"] / peak if t == 1 else None
                    result["products"].append(row)
    finally:
        torch.set_num_threads(previous)
    return result


def format_table(result: dict) -> str:
    per_core = result["peak_per_core"]
    lines = [f"FMA peak: {per_core:.1f} GFLOP/s per core (vectors of {result['panel_width'] // 2} floats); "
             + ", ".join(f"{t} threads together {g:.1f}" for t, g in result["peak"].items()),
             "", "| K x N | layer | M | threads | packed GFLOP/s | of peak | packed, CPU clock | of peak | F.linear GFLOP/s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["products"]:
        name = SHAPES.get((r["k"], r["n"]), "")
        cpu = f"{r['packed_cpu_gflops']:.1f} | {r['cpu_of_peak']:.0%}" if r["packed_cpu_gflops"] else "- | -"
        tl = f"{r['torch_gflops']:.1f}" if "torch_gflops" in r else "-"
        lines.append(f"| {r['k']}x{r['n']} | {name} | {r['m']} | {r['threads']} | {r['packed_gflops']:.1f} | "
                     f"{r['of_peak']:.0%} | {cpu} | {tl} |")
    large = [r for r in result["products"] if r["m"] >= 256]
    if large:
        worst = min(large, key=lambda r: max(r["of_peak"], r["cpu_of_peak"] or 0.0))
        best_of = max(worst["of_peak"], worst["cpu_of_peak"] or 0.0)
        lines.append(f"\nproducts of 256 rows or more: the lowest at {best_of:.0%} of peak x threads "
                     f"({worst['k']}x{worst['n']}, {worst['m']} rows, {worst['threads']} threads; "
                     f"bar {TARGET:.0%})")
        for t in sorted({r["threads"] for r in large}):
            of = [max(r["of_peak"], r["cpu_of_peak"] or 0.0) for r in large if r["threads"] == t]
            below = sum(v < TARGET for v in of)
            lines.append(f"  at {t} thread{'s' if t > 1 else ''}: {min(of):.0%}-{max(of):.0%} of peak"
                         f"{' (CPU clock)' if t == 1 else ' (wall clock)'}, {below} of {len(of)} below the bar")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if load is not None:
        lines.append(f"load average while measuring: {load:.2f} on {os.cpu_count()} CPUs "
                     "(a load above the thread count makes the wall-clock figures low)")
    return "\n".join(lines)


def _shapes(text: str) -> tuple[tuple[int, int], ...]:
    return tuple(tuple(int(v) for v in s.split("x")) for s in text.split(",") if s)  # type: ignore[misc]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gemm_peak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=comma_ints, default=ROWS, help="comma-separated M values")
    parser.add_argument("--shapes", type=_shapes, default=tuple(SHAPES), help="comma-separated KxN weights")
    parser.add_argument("--threads", type=comma_ints, default=(1, 2))
    parser.add_argument("--repeats", type=int, default=5, help="runs per product; the best is kept")
    parser.add_argument("--no-torch", action="store_true", help="skip F.linear")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    result = measure(args.rows, args.shapes, args.threads, args.repeats, torch_too=not args.no_torch)
    return emit(result, format_table, args.json)


if __name__ == "__main__":
    sys.exit(main())
