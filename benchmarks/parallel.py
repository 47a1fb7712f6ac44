"""`kvserve bench-parallel`: the same workload at TP=1 x PP=1 (in-process) and at the tensor- and
pipeline-parallel sizes asked for (Ray worker actors): engine start time, throughput, the per-step
dispatch overhead (scheduler to ranks and back, outside the sampling rank's own work) and, under
pipeline parallelism, each stage's compute and wait per step (the wait is the bubble: with one batch in
flight a stage waits while the stages before it run)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.workloads import distinct
from engine import LLM, SamplingParams


def parse_config(text: str) -> tuple[int, int]:
    """"TPxPP" (e.g. 2x1, 1x2), or a bare TP."""
    try:
        tp, _, pp = text.lower().partition("x")
        sizes = int(tp), int(pp or 1)
    except ValueError:
        sizes = (0, 0)
    if min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"a parallel configuration is TPxPP, such as 2x1 or 1x2 (got {text!r})")
    return sizes


def add_bench_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory or Hugging Face repo id (default: the llama `small` preset)")
    parser.add_argument("--configs", type=parse_config, nargs="+", default=[(1, 1), (2, 1), (1, 2)],
                        help="tensor x pipeline parallel sizes to compare, as TPxPP (default: 1x1 2x1 1x2)")
    parser.add_argument("--dispatch", nargs="+", default=["remote", "compiled"],
                        help="dispatch modes to try on Ray ranks")
    parser.add_argument("--batches-in-flight", type=int, nargs="+", default=[0],
                        help="steps in flight to try at PP > 1 (0: the default, one per stage)")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--json", help="also write the report to this file")


def run_one(model: str, tp: int, pp: int, dispatch: str, workload, in_flight: int = 0) -> dict:
    start = time.perf_counter()
    with LLM(model=model, tensor_parallel_size=tp, pipeline_parallel_size=pp, tp_dispatch=dispatch,
             batches_in_flight=in_flight or None) as llm:
        in_flight = llm.core.executor.max_steps_in_flight
        startup = time.perf_counter() - start
        params = SamplingParams(temperature=0.0, max_tokens=workload.output_len, ignore_eos=True)
        llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
        timings = llm.core.timings
        timings.dispatch_samples.clear()
        steps_before, step_time_before = timings.num_steps, timings.step_time_s
        stages_before = pipeline_times(llm)
        begin = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params)
        elapsed = time.perf_counter() - begin
        dispatch_us = [1e6 * d for d in timings.dispatch_samples]
        steps = timings.num_steps - steps_before
        step_ms = 1000 * (timings.step_time_s - step_time_before) / steps
        stages = pipeline_times(llm)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    run = {
        "tp": tp, "pp": pp, "dispatch": dispatch if tp * pp > 1 else "in-process", "in_flight": in_flight,
        "startup_s": startup,
        "output_tokens_per_s": tokens / elapsed, "elapsed_s": elapsed,
        "step_ms": step_ms,
        "dispatch_us_median": statistics.median(dispatch_us),
        "dispatch_us_p90": sorted(dispatch_us)[int(0.9 * (len(dispatch_us) - 1))],
        "token_ids": [o.outputs[0].token_ids for o in outputs],
    }
    if stages is not None:  # per stage, per step of the measured run
        n = stages["steps"] - stages_before["steps"]
        run["stage_compute_ms"] = [1000 * (a - b) / n for a, b in zip(stages["stage_compute_s"],
                                                                     stages_before["stage_compute_s"])]
        run["stage_wait_ms"] = [1000 * (a - b) / n for a, b in zip(stages["stage_wait_s"], stages_before["stage_wait_s"])]
    return run


def pipeline_times(llm) -> dict | None:
    times = getattr(llm.core.executor, "pipeline_times", None)
    return times() if times is not None and llm.config.parallel.pipeline_parallel_size > 1 else None


def bench_parallel(model: str, configs: list[tuple[int, int]], dispatch_modes: list[str], num_requests: int = 16,
                   prompt_len: int = 128, output_len: int = 32, in_flight: tuple[int, ...] = (0,)) -> dict:
    from cluster.ray_env import ensure_ray

    start = time.perf_counter()
    ensure_ray(min_cpus=max(tp * pp for tp, pp in configs) + 2)
    ray_init_s = time.perf_counter() - start
    workload = distinct(model, num_requests, prompt_len, output_len)
    runs = []
    for tp, pp in configs:
        for dispatch in (dispatch_modes if tp * pp > 1 else ["remote"]):
            for steps in (in_flight if pp > 1 else (0,)):
                runs.append(run_one(model, tp, pp, dispatch, workload, steps))
    reference = runs[0].pop("token_ids")
    same = all(r.pop("token_ids") == reference for r in runs[1:])
    return {"model": model, "ray_init_s": ray_init_s, "runs": runs, "same_tokens": same,
            "workload": {"num_requests": num_requests, "prompt_len": prompt_len, "output_len": output_len}}


def format_parallel_report(report: dict) -> str:
    w = report["workload"]
    lines = [f"{w['num_requests']} requests x {w['prompt_len']} prompt tokens, {w['output_len']} output tokens, "
             f"greedy; ray.init {report['ray_init_s']:.1f}s; same tokens in every configuration: "
             f"{report['same_tokens']}", "",
             "| TP | PP | dispatch | in flight | start s | output tok/s | step ms | dispatch µs p50 | p90 | "
             "per stage: compute / wait ms |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in report["runs"]:
        stages = ", ".join(f"{c:.1f} / {w:.1f}" for c, w in zip(r["stage_compute_ms"], r["stage_wait_ms"])) \
            if "stage_compute_ms" in r else ""
        # with steps in flight a step's time runs from its sending to its collection (they overlap), and
        # the dispatch is not measured apart
        dispatch = (f"{r['dispatch_us_median']:.0f} | {r['dispatch_us_p90']:.0f}" if r["in_flight"] == 1 else "- | -")
        lines.append(f"| {r['tp']} | {r['pp']} | {r['dispatch']} | {r['in_flight']} | {r['startup_s']:.1f} | "
                     f"{r['output_tokens_per_s']:.1f} | {r['step_ms']:.1f} | {dispatch} | {stages} |")
    return "\n".join(lines)


def run_bench_parallel(args: argparse.Namespace) -> int:
    from workers.model_source import resolve_model

    args.model = str(resolve_model(args.model))  # a directory, a Hugging Face repo id, or the default
    report = bench_parallel(args.model, args.configs, args.dispatch, args.num_requests, args.prompt_len,
                            args.output_len, tuple(args.batches_in_flight))
    print(format_parallel_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
