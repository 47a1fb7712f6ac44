"""`kvserve bench`: kvserve against its peers on the same checkpoint, prompts and threads.

Offline, each system runs each workload in this process: Hugging Face `generate` with static
batches, Hugging Face continuous batching (`generate_batch`, paged attention), and kvserve's engine
with prefix caching off and on. Online, the Serve app (started here on a local Ray cluster, or the
server at --url) takes the same workloads over HTTP at fixed concurrencies and/or Poisson rates.
Results go to the terminal and to --out as JSON, Markdown and PNG plots.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import sys
import time
import uuid

import torch

from benchmarks.hf_peer import run_hf_continuous, run_hf_static
from benchmarks.offline import measure_step_overhead, run_kvserve
from benchmarks.online import run_online
from benchmarks.report import format_console, write_report
from benchmarks.targets import evaluate_targets
from benchmarks.workloads import WORKLOADS, build_workload

SYSTEMS = ("hf-static", "hf-continuous", "kvserve-nocache", "kvserve-cache", "serve-http")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory (default: the llama `small` preset, built if missing)")
    parser.add_argument("--workload", nargs="+", choices=(*WORKLOADS, "all"), default=["shared-system-prompt"])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--scale", type=float, default=1.0, help="workload size factor (1.0: 64 requests)")
    parser.add_argument("--output-len", type=int, help="output tokens per request (default: the workload's)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, every system alike")
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=8, help="kvserve's KV block size in tokens (8 halves "
                        "the partly filled tail blocks of 16; both are cheap on CPU)")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[8, 64],
                        help="online: requests in flight, one run each")
    parser.add_argument("--request-rate", type=float, nargs="*", default=[4.0],
                        help="online: Poisson arrival rates (requests/s), one run each")
    parser.add_argument("--stream-interval", type=int, default=1, help="online: the started app's tokens per "
                        "streamed chunk")
    parser.add_argument("--url", help="online: measure this running server instead of starting the Serve app")
    parser.add_argument("--served-model-name", default="bench", help="online: the model name the server serves")
    parser.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"), help="online: the server's key")
    parser.add_argument("--overhead-seqs", type=int, default=64, help="running sequences for the overhead probe "
                        "(0 to skip it)")
    parser.add_argument("--out", default="bench-results", help="directory for report.json, report.md and plots")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_bench(args: argparse.Namespace) -> int:
    if args.model is None:
        from workers.model_builder import default_model_dir

        args.model = str(default_model_dir())
    workloads = list(WORKLOADS) if "all" in args.workload else args.workload
    report = bench(args.model, workloads=workloads, systems=args.systems, scale=args.scale,
                   output_len=args.output_len, threads=args.threads, hf_batch_size=args.hf_batch_size,
                   block_size=args.block_size, stream_interval=args.stream_interval,
                   concurrency=args.concurrency, request_rates=args.request_rate, url=args.url,
                   served_model_name=args.served_model_name, api_key=args.api_key, overhead_seqs=args.overhead_seqs,
                   progress=not args.no_progress, command="kvserve bench " + shlex.join(sys.argv[2:]))
    print(format_console(report))
    paths = write_report(report, args.out)
    print(f"\nwrote {paths['json']}, {paths['markdown']} and {len(paths['plots'])} plots in {args.out}")
    return 0


class _Progress:
    """A tqdm bar per run (to stderr), or nothing."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, total: int, desc: str):
        from contextlib import nullcontext

        if not self.enabled:
            return nullcontext(None)
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="req", leave=False, file=sys.stderr, dynamic_ncols=True)


def _updater(bar):
    return None if bar is None else bar.update


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of requests whose greedy tokens are identical in both runs."""
    return sum(x == y for x, y in zip(a, b)) / len(a) if a else 0.0


def _offline_runs(model: str, workload, systems: list[str], hf_batch_size: int, block_size: int,
                  bars: _Progress) -> list[dict]:
    runners = {
        "hf-static": lambda p: run_hf_static(model, workload, hf_batch_size, progress=p),
        "hf-continuous": lambda p: run_hf_continuous(model, workload, progress=p),
        "kvserve-nocache": lambda p: run_kvserve(model, workload, enable_prefix_caching=False, progress=p,
                                                 block_size=block_size),
        "kvserve-cache": lambda p: run_kvserve(model, workload, enable_prefix_caching=True, progress=p,
                                               block_size=block_size),
    }
    runs = []
    for system in (s for s in SYSTEMS if s in systems and s in runners):
        with bars(len(workload.requests), f"{workload.name} / {system}") as bar:
            runs.append(runners[system](_updater(bar)))
    tokens = {run["name"]: run.pop("token_ids") for run in runs}
    cache = tokens.get("kvserve-cache")
    for run in runs:
        if cache is not None and run["name"] != "kvserve-cache":
            run["same_tokens_as_kvserve_cache"] = _agreement(tokens[run["name"]], cache)
    return runs


def _start_serve_app(model: str, threads: int, max_num_seqs: int, block_size: int,
                     stream_interval: int) -> tuple[str, float]:
    from benchmarks.serve_bench import start_app

    return start_app(model, max_num_seqs, threads, enable_prefix_caching=True, block_size=block_size,
                     stream_interval=stream_interval)


def _online_runs(url: str, served_name: str, api_key: str | None, workload, concurrency: list[int],
                 rates: list[float], bars: _Progress) -> list[dict]:
    runs = []
    loads = [{"concurrency": c} for c in concurrency] + [{"request_rate": r} for r in rates]
    for load in loads:
        label = f"c={load['concurrency']}" if "concurrency" in load else f"{load['request_rate']:g} req/s"
        with bars(len(workload.requests), f"{workload.name} / serve-http {label}") as bar:
            run = asyncio.run(run_online(url, served_name, workload, progress=_updater(bar), api_key=api_key,
                                         cache_salt=uuid.uuid4().hex, **load))
        run.pop("token_ids")
        runs.append(run)
    return runs


def _model_params(model: str) -> int:
    import math
    from pathlib import Path

    from safetensors import safe_open

    total = 0
    for path in Path(model).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            total += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    return total


def bench(model: str, *, workloads: list[str], systems: list[str], scale: float = 1.0, output_len: int | None = None,
          threads: int = 2, hf_batch_size: int = 8, block_size: int = 8, stream_interval: int = 1,
          concurrency: list[int] = (8, 64), request_rates: list[float] = (), url: str | None = None,
          served_model_name: str = "bench", api_key: str | None = None, overhead_seqs: int = 64,
          progress: bool = True, command: str = "kvserve bench") -> dict:
    torch.set_num_threads(threads)
    bars = _Progress(progress)
    built = {name: build_workload(name, model, scale, output_len) for name in workloads}
    report = {
        "command": command,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": threads,
                    "torch": torch.__version__, "python": sys.version.split()[0]},
        "model": model, "model_params": _model_params(model), "kvserve": {"block_size": block_size},
        "workloads": {},
    }
    for name, workload in built.items():
        report["workloads"][name] = {"description": workload.description, "num_requests": len(workload.requests),
                                     "prompt_tokens": workload.num_prompt_tokens,
                                     "runs": _offline_runs(model, workload, systems, hf_batch_size, block_size,
                                                           bars)}
    if overhead_seqs and ("kvserve-cache" in systems or "kvserve-nocache" in systems):
        report["overhead"] = measure_step_overhead(model, num_seqs=overhead_seqs, block_size=block_size)
    if "serve-http" in systems and (concurrency or request_rates):
        deploy_s = None
        if url is None:
            url, deploy_s = _start_serve_app(model, threads, 256, block_size, stream_interval)
            served_model_name = "bench"
        try:
            for name, workload in built.items():
                report["workloads"][name]["online"] = _online_runs(url, served_model_name, api_key, workload,
                                                                   list(concurrency), list(request_rates), bars)
        finally:
            if deploy_s is not None:
                from ray import serve

                serve.shutdown()
        report["serve"] = {"url": url, "deploy_s": deploy_s,
                           "stream_interval": stream_interval if deploy_s is not None else None}
    for name, section in report["workloads"].items():
        section["targets"] = evaluate_targets(name, section, report.get("overhead"))
    report["finished_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return report
