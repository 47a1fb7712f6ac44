"""`kvserve bench`: kvserve with prefix caching on and off against Hugging Face static batching on
the shared-prefix workload, plus the engine's step overhead at a full decode batch."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

from benchmarks.hf_peer import run_hf_static
from benchmarks.offline import measure_step_overhead, run_kvserve
from benchmarks.workloads import shared_prefix


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory (default: the llama `small` preset, built if missing)")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=30)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--overhead-seqs", type=int, default=64, help="running sequences for the overhead probe")
    parser.add_argument("--skip-hf", action="store_true", help="leave out the Hugging Face peer")
    parser.add_argument("--json", help="also write the report to this file")


def run_bench(args: argparse.Namespace) -> int:
    if args.model is None:
        from workers.model_builder import default_model_dir

        args.model = str(default_model_dir())
    report = bench(args.model, num_requests=args.num_requests, prefix_len=args.prefix_len,
                   suffix_len=args.suffix_len, output_len=args.output_len, hf_batch_size=args.hf_batch_size,
                   overhead_seqs=args.overhead_seqs, include_hf=not args.skip_hf)
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def bench(model: str, *, num_requests: int = 48, prefix_len: int = 512, suffix_len: int = 30, output_len: int = 32,
          hf_batch_size: int = 8, overhead_seqs: int = 64, include_hf: bool = True) -> dict:
    workload = shared_prefix(model, num_requests, prefix_len, suffix_len, output_len)
    max_len = max(map(len, workload.prompts)) + output_len
    engine_kwargs = {"max_model_len": max_len}
    runs = [run_kvserve(model, workload, enable_prefix_caching=True, **engine_kwargs),
            run_kvserve(model, workload, enable_prefix_caching=False, **engine_kwargs)]
    if include_hf:
        runs.append(run_hf_static(model, workload, hf_batch_size))
    on, off = runs[0], runs[1]
    token_ids = [r.pop("token_ids", None) for r in runs]
    report = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "torch": torch.__version__, "python": sys.version.split()[0]},
        "model": model,
        "workload": {"name": workload.name, "num_requests": num_requests, "prefix_len": prefix_len,
                     "suffix_len": suffix_len, "output_len": output_len,
                     "prompt_tokens": workload.num_prompt_tokens},
        "runs": runs,
        "same_tokens_cache_on_off": token_ids[0] == token_ids[1],
        "speedup_cache_vs_nocache": on["output_tokens_per_s"] / off["output_tokens_per_s"],
        "overhead": measure_step_overhead(model, num_seqs=overhead_seqs),
    }
    if include_hf:
        report["speedup_cache_vs_hf_static"] = on["output_tokens_per_s"] / runs[2]["output_tokens_per_s"]
    return report


def format_report(report: dict) -> str:
    w = report["workload"]
    lines = [f"shared-prefix: {w['num_requests']} requests, {w['prefix_len']}-token prefix, ~{w['suffix_len']}-token "
             f"suffixes, {w['output_len']} output tokens, greedy; torch threads {report['machine']['torch_threads']}",
             "", "| run | output tok/s | elapsed s | prefix hit rate |", "|---|---:|---:|---:|"]
    for run in report["runs"]:
        rate = f"{run['prefix_cache_hit_rate']:.3f}" if "prefix_cache_hit_rate" in run else "-"
        lines.append(f"| {run['name']} | {run['output_tokens_per_s']:.1f} | {run['elapsed_s']:.2f} | {rate} |")
    lines.append("")
    lines.append(f"caching on / off: {report['speedup_cache_vs_nocache']:.2f}x"
                 f" (same tokens: {report['same_tokens_cache_on_off']})")
    if "speedup_cache_vs_hf_static" in report:
        lines.append(f"caching on / HF static: {report['speedup_cache_vs_hf_static']:.2f}x")
    o = report["overhead"]
    lines.append(f"step overhead at {o['num_running']} running sequences: {100 * o['overhead_fraction']:.1f}% "
                 f"(step {o['step_ms']:.1f} ms, forward {o['forward_ms']:.1f} ms)")
    return "\n".join(lines)
