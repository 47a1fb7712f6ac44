"""`kvserve bench-serve`: the Serve app over HTTP at several concurrencies against the offline engine
on the same workload, threads and batch limit. Starts a local Ray cluster and the app itself, or
measures a running server (--url). Prefix caching is off in both: the same prompts run repeatedly,
and this measures the serving path, not the cache."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from benchmarks.offline import run_kvserve
from benchmarks.online import run_online
from benchmarks.workloads import BenchRequest, Workload, distinct


def add_bench_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory or Hugging Face repo id (default: the llama `small` preset)")
    parser.add_argument("--url", help="measure this running server instead of starting one")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the engine, both modes")
    parser.add_argument("--no-stream", action="store_true", help="also measure unstreamed requests")
    parser.add_argument("--repeats", type=int, default=2, help="offline / top-concurrency alternations")
    parser.add_argument("--json", help="also write the report to this file")


def start_app(model: str, max_num_seqs: int, threads: int, enable_prefix_caching: bool = False,
              block_size: int = 16, stream_interval: int = 1) -> tuple[str, float]:
    """A local Ray cluster and the Serve app on 127.0.0.1:8000; returns its URL and deploy time."""
    import ray
    from ray import serve

    from serve_app import build_app

    ray.init(num_cpus=threads + 2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    start = time.perf_counter()
    serve.run(build_app({"model": model, "served_model_name": "bench", "max_num_seqs": max_num_seqs,
                         "engine_cpus": threads, "torch_threads": threads,
                         "enable_prefix_caching": enable_prefix_caching, "block_size": block_size,
                         "stream_interval": stream_interval}),
              name="bench", route_prefix="/")
    return "http://127.0.0.1:8000", time.perf_counter() - start


def _offline_in_fresh_process(model: str, workload: Workload, max_num_seqs: int, threads: int) -> dict:
    """The offline engine in a process of its own (no Ray in it), beside the idle Serve cluster."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_offline_worker, (model, workload, max_num_seqs, threads))


def _offline_worker(model: str, workload: Workload, max_num_seqs: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    return _light(run_kvserve(model, workload, enable_prefix_caching=False, warm_up=True, max_num_seqs=max_num_seqs))


def _light(run: dict) -> dict:
    """A run without its per-token payload."""
    return {k: v for k, v in run.items() if k not in ("token_ids", "timeline", "ttft_samples_s")}


def bench_serve(model: str, *, url: str | None = None, concurrency: list[int], num_requests: int, prompt_len: int,
                output_len: int, max_num_seqs: int, threads: int, unstreamed: bool = False, repeats: int = 2) -> dict:
    """Offline and HTTP at the highest concurrency alternate ``repeats`` times (this machine's speed
    drifts; the ratio is of medians); lower concurrencies run once."""
    workload = distinct(model, num_requests, prompt_len, output_len)
    deploy_s = None
    if url is None:
        url, deploy_s = start_app(model, max_num_seqs, threads)
    def load(concurrency: int, stream: bool = True) -> dict:
        return _light(asyncio.run(run_online(url, "bench", workload, concurrency=concurrency, stream=stream)))

    warm_up = Workload("warm-up", [BenchRequest(r.prompt, 4) for r in workload.requests[:4]])
    asyncio.run(run_online(url, "bench", warm_up, concurrency=4))
    online = [load(c) for c in concurrency[:-1]]
    offline_runs, top_runs, unstreamed_runs = [], [], []
    for _ in range(repeats):
        offline_runs.append(_offline_in_fresh_process(model, workload, max_num_seqs, threads))
        top_runs.append(load(concurrency[-1]))
        if unstreamed:
            unstreamed_runs.append(load(concurrency[-1], stream=False))
    if deploy_s is not None:
        from ray import serve

        serve.shutdown()
    median = lambda runs: sorted(runs, key=lambda r: r["output_tokens_per_s"])[(len(runs) - 1) // 2]  # noqa: E731
    online.append(median(top_runs))
    if unstreamed:
        online.append(median(unstreamed_runs))
    offline = median(offline_runs)
    return {"model": model, "threads": threads, "max_num_seqs": max_num_seqs, "deploy_s": deploy_s,
            "workload": {"num_requests": num_requests, "prompt_len": prompt_len, "output_len": output_len},
            "offline": offline, "online": online, "repeats": repeats,
            "samples_tok_s": {"offline": [r["output_tokens_per_s"] for r in offline_runs],
                              "streamed": [r["output_tokens_per_s"] for r in top_runs],
                              "unstreamed": [r["output_tokens_per_s"] for r in unstreamed_runs]},
            "saturation_ratio": online[len(concurrency) - 1]["output_tokens_per_s"] / offline["output_tokens_per_s"],
            "saturation_ratio_unstreamed": (online[-1]["output_tokens_per_s"] / offline["output_tokens_per_s"]
                                            if unstreamed else None)}


def format_serve_report(report: dict) -> str:
    w = report["workload"]
    lines = [f"{w['num_requests']} requests x {w['prompt_len']} prompt tokens, {w['output_len']} output tokens, "
             f"greedy; engine threads {report['threads']}, max_num_seqs {report['max_num_seqs']}", "",
             "| mode | concurrency | output tok/s | TTFT p50 ms | latency p50 s |", "|---|---:|---:|---:|---:|"]
    for r in report["online"]:
        mode = "HTTP (Serve), unstreamed" if r["name"].endswith("unstreamed") else "HTTP (Serve), streamed"
        lines.append(f"| {mode} | {r['concurrency']} | {r['output_tokens_per_s']:.1f} | "
                     f"{1000 * r['ttft_s']['p50']:.0f} | {r['e2e_s']['p50']:.2f} |")
    lines.append(f"| offline LLM | all at once | {report['offline']['output_tokens_per_s']:.1f} | - | - |")
    lines.append("")
    lines.append(f"highest concurrency / offline (medians of {report['repeats']}): streamed "
                 f"{report['saturation_ratio']:.2f}" + (f", unstreamed {report['saturation_ratio_unstreamed']:.2f}"
                                                         if report["saturation_ratio_unstreamed"] else ""))
    lines.append("samples (tok/s): " + "; ".join(f"{k} {', '.join(f'{v:.0f}' for v in vs)}"
                                                for k, vs in report["samples_tok_s"].items() if vs))
    if report["deploy_s"] is not None:
        lines.append(f"app deploy (serve.run, model loaded): {report['deploy_s']:.1f}s")
    return "\n".join(lines)


def run_bench_serve(args: argparse.Namespace) -> int:
    from workers.model_source import resolve_model

    args.model = str(resolve_model(args.model))  # a directory, a Hugging Face repo id, or the default
    report = bench_serve(args.model, url=args.url, concurrency=args.concurrency, num_requests=args.num_requests,
                         prompt_len=args.prompt_len, output_len=args.output_len, max_num_seqs=args.max_num_seqs,
                         threads=args.threads, unstreamed=args.no_stream, repeats=args.repeats)
    print(format_serve_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
