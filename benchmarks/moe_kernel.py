"""`python -m benchmarks.moe_kernel`: the compiled experts op (``kvserve_cpu::moe_experts``) with its
weights in float32 panels against the same weights split for the bf16x3 product (what
``cpu_matmul_precision="high"`` gives where the CPU grants AMX tiles), on one mixture-of-experts layer.

The layer is random (hidden x intermediate, ``--experts`` experts, top ``--top-k``, router logits drawn
at random, so the experts get about equal rows). For each batch of ``--tokens`` tokens the two layouts
take turns ``--rounds`` times, each round the best of ``--repeats`` calls on the wall clock; every round
is reported (this kind of host's speed drifts by minutes: a single pair of figures is not a
comparison), with the best of each and their ratio. The split layout is the one
``FusedMoE.pack_for_cpu`` gives under "high": each of w13 and w2 split where 32 divides its input
features (hidden, intermediate), the other in float32 panels. Before timing, its output is set
against the float32 one's: their largest difference over the output's scale must stay within the
bf16x3 bound of two chained products (``MAX_SPLIT_ERROR``), or the run stops. Where the CPU or the
build grants no AMX tiles only float32 is timed, and the report says why.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

from benchmarks.op_report import comma_ints, emit
from kernels.cpu.layer_ops import lay_out_expert_weight

# two chained products each within the dense bf16x3 bound of 3e-5 of the output's scale
# (tests/kernels/test_cpu_moe.py measures at most 4.4e-5 over its shapes)
MAX_SPLIT_ERROR = 6e-5


def _ops():
    from kernels.cpu import load, load_error

    ops = load()
    if ops is None:
        raise SystemExit(f"the compiled CPU kernels are not available here: {load_error()}")
    return ops


def layer(hidden: int, intermediate: int, experts: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [experts, 2 x intermediate, hidden] (gate rows, then up rows) and w2 [experts, hidden,
    intermediate], scaled so that the activations stay of order one."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * intermediate, hidden, generator=gen) / math.sqrt(hidden)
    w2 = torch.randn(experts, hidden, intermediate, generator=gen) / math.sqrt(intermediate)
    return w13, w2


def batch(tokens: int, hidden: int, experts: int, top_k: int, seed: int = 0):
    """x [tokens, hidden] and its routing (weights, expert ids: [tokens, top_k])."""
    from kernels.torch_moe import select_experts

    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = select_experts(torch.randn(tokens, experts, generator=gen), top_k, renormalize=True)
    return x, weights, ids


def _best(fn, repeats: int) -> float:
    fn()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(hidden: int = 1024, intermediate: int = 2816, experts: int = 8, top_k: int = 2,
            tokens=(16, 512, 2048), rounds: int = 15, repeats: int = 3, threads: int = 2, seed: int = 0) -> dict:
    ops = _ops()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w13, w2 = layer(hidden, intermediate, experts, seed)
        layouts = {"float32": (ops.moe_pack_weight(w13), ops.moe_pack_weight(w2))}
        split_why = ""
        if not ops.amx_usable():
            split_why = "the bf16x3 product needs AMX tiles, which this CPU, OS or build does not grant"
        elif hidden % 32 and intermediate % 32:
            split_why = (f"the split needs a multiple of 32 input features, which neither hidden ({hidden}) nor "
                         f"intermediate ({intermediate}) is")
        split = []
        if not split_why:  # as FusedMoE.pack_for_cpu lays them out: each weight split where 32 divides its inputs
            laid = [lay_out_expert_weight(ops, w, split=True) for w in (w13, w2)]
            layouts["bf16x3"] = tuple(weight for weight, _ in laid)
            split = [was_split for _, was_split in laid]
        result: dict = {"hidden": hidden, "intermediate": intermediate, "experts": experts, "top_k": top_k,
                        "threads": threads, "rounds": rounds, "repeats": repeats, "split_unavailable": split_why,
                        "split": split, "batches": []}
        for n in tokens:
            x, weights, ids = batch(n, hidden, experts, top_k, seed)
            run = {name: (lambda a=a, b=b: ops.moe_experts(x, a, b, weights, ids, 0, intermediate))
                   for name, (a, b) in layouts.items()}
            entry: dict = {"tokens": n, "rows_per_expert": [int((ids == e).sum()) for e in range(experts)],
                           "seconds": {name: [] for name in layouts}}
            if "bf16x3" in layouts:
                want, got = run["float32"](), run["bf16x3"]()
                entry["split_error"] = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
                if not entry["split_error"] <= MAX_SPLIT_ERROR:
                    raise RuntimeError(f"the split experts' output is {entry['split_error']:.2e} of the output's "
                                       f"scale from the float32 one's at {n} tokens, beyond {MAX_SPLIT_ERROR:.0e}")
            for r in range(rounds):
                order = list(layouts) if r % 2 == 0 else list(reversed(layouts))
                for name in order:
                    entry["seconds"][name].append(_best(run[name], repeats))
            result["batches"].append(entry)
    finally:
        torch.set_num_threads(previous)
    return result


def format_table(result: dict) -> str:
    names = list(result["batches"][0]["seconds"]) if result["batches"] else []
    lines = [f"moe_experts: hidden {result['hidden']}, intermediate {result['intermediate']}, {result['experts']} "
             f"experts, top {result['top_k']}, {result['threads']} threads; {result['rounds']} rounds taking turns, "
             f"each the best of {result['repeats']} calls (ms)"]
    if result["split_unavailable"]:
        lines.append(f"bf16x3 not timed: {result['split_unavailable']}")
    elif result["split"] and not all(result["split"]):
        kept = [name for name, split in zip(("w13 (gate|up)", "w2 (down)"), result["split"]) if not split]
        lines.append(f"bf16x3: {kept[0]} stays in float32 panels (32 does not divide its input features)")
    head = " | ".join(f"{n} best | {n} range" for n in names)
    lines += ["", f"| tokens | rows per expert | {head} |" + (" float32 / bf16x3 |" if "bf16x3" in names else ""),
              "|---:|---|" + "---:|" * (2 * len(names)) + ("---:|" if "bf16x3" in names else "")]
    for b in result["batches"]:
        cells = []
        for n in names:
            ms = [1000 * s for s in b["seconds"][n]]
            cells.append(f"{min(ms):.2f} | {min(ms):.2f}-{max(ms):.2f}")
        rows = f"{min(b['rows_per_expert'])}-{max(b['rows_per_expert'])}"
        ratio = f" {min(b['seconds']['float32']) / min(b['seconds']['bf16x3']):.2f}x |" if "bf16x3" in names else ""
        lines.append(f"| {b['tokens']} | {rows} | {' | '.join(cells)} |{ratio}")
    errors = [b["split_error"] for b in result["batches"] if "split_error" in b]
    if errors:
        lines.append(f"\nbf16x3 against float32: at most {max(errors):.1e} of the output's scale "
                     f"(bound {MAX_SPLIT_ERROR:.0e})")
    if hasattr(os, "getloadavg"):
        lines.append(f"load average while measuring: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moe_kernel", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816, help="each expert's intermediate features")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=comma_ints, default=(16, 512, 2048), help="comma-separated batch sizes")
    parser.add_argument("--rounds", type=int, default=15, help="turns each layout takes")
    parser.add_argument("--repeats", type=int, default=3, help="calls per round; the best is kept")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if not 1 <= args.top_k <= args.experts:
        parser.error(f"--top-k must be between 1 and the {args.experts} experts, not {args.top_k}")
    for name in ("rounds", "repeats", "threads", "hidden", "intermediate", "experts"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, not {getattr(args, name)}")
    if not args.tokens or min(args.tokens) < 1:
        parser.error("--tokens must list batch sizes of at least 1 token")
    result = measure(args.hidden, args.intermediate, args.experts, args.top_k, args.tokens, args.rounds,
                     args.repeats, args.threads)
    return emit(result, format_table, args.json)


if __name__ == "__main__":
    sys.exit(main())
