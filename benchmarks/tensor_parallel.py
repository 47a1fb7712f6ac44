"""`kvserve bench-tp`: the same workload at TP=1 (in-process) and TP=N (Ray worker actors): engine
start time, throughput, and the per-step dispatch overhead (scheduler to ranks and back, outside
rank 0's own work)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.workloads import distinct
from engine import LLM, SamplingParams


def add_bench_tp_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory or Hugging Face repo id (default: the llama `small` preset)")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes to compare")
    parser.add_argument("--dispatch", nargs="+", default=["remote", "compiled"],
                        help="dispatch modes to try at TP > 1")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--json", help="also write the report to this file")


def run_one(model: str, tp: int, dispatch: str, workload) -> dict:
    start = time.perf_counter()
    with LLM(model=model, tensor_parallel_size=tp, tp_dispatch=dispatch) as llm:
        startup = time.perf_counter() - start
        params = SamplingParams(temperature=0.0, max_tokens=workload.output_len, ignore_eos=True)
        llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
        timings = llm.core.timings
        timings.dispatch_samples.clear()
        steps_before, step_time_before = timings.num_steps, timings.step_time_s
        begin = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params)
        elapsed = time.perf_counter() - begin
        dispatch_us = [1e6 * d for d in timings.dispatch_samples]
        steps = timings.num_steps - steps_before
        step_ms = 1000 * (timings.step_time_s - step_time_before) / steps
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "tp": tp, "dispatch": dispatch if tp > 1 else "in-process", "startup_s": startup,
        "output_tokens_per_s": tokens / elapsed, "elapsed_s": elapsed,
        "step_ms": step_ms,
        "dispatch_us_median": statistics.median(dispatch_us),
        "dispatch_us_p90": sorted(dispatch_us)[int(0.9 * (len(dispatch_us) - 1))],
        "token_ids": [o.outputs[0].token_ids for o in outputs],
    }


def bench_tp(model: str, tp_sizes: list[int], dispatch_modes: list[str], num_requests: int = 16,
             prompt_len: int = 128, output_len: int = 32) -> dict:
    from cluster.ray_env import ensure_ray

    start = time.perf_counter()
    ensure_ray(min_cpus=max(tp_sizes) + 2)
    ray_init_s = time.perf_counter() - start
    workload = distinct(model, num_requests, prompt_len, output_len)
    runs = []
    for tp in tp_sizes:
        for dispatch in (dispatch_modes if tp > 1 else ["remote"]):
            runs.append(run_one(model, tp, dispatch, workload))
    reference = runs[0].pop("token_ids")
    same = all(r.pop("token_ids") == reference for r in runs[1:])
    return {"model": model, "ray_init_s": ray_init_s, "runs": runs, "same_tokens": same,
            "workload": {"num_requests": num_requests, "prompt_len": prompt_len, "output_len": output_len}}


def format_tp_report(report: dict) -> str:
    w = report["workload"]
    lines = [f"{w['num_requests']} requests x {w['prompt_len']} prompt tokens, {w['output_len']} output tokens, "
             f"greedy; ray.init {report['ray_init_s']:.1f}s; same tokens at every TP: {report['same_tokens']}", "",
             "| TP | dispatch | start s | output tok/s | step ms | dispatch µs p50 | p90 |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in report["runs"]:
        lines.append(f"| {r['tp']} | {r['dispatch']} | {r['startup_s']:.1f} | {r['output_tokens_per_s']:.1f} | "
                     f"{r['step_ms']:.1f} | {r['dispatch_us_median']:.0f} | {r['dispatch_us_p90']:.0f} |")
    return "\n".join(lines)


def run_bench_tp(args: argparse.Namespace) -> int:
    from workers.model_source import resolve_model

    args.model = str(resolve_model(args.model))  # a directory, a Hugging Face repo id, or the default
    report = bench_tp(args.model, args.tp, args.dispatch, args.num_requests, args.prompt_len, args.output_len)
    print(format_tp_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
