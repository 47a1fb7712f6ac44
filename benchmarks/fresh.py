"""Every benchmark system in a fresh process of its own, one per system and workload.

The parent (`kvserve bench`) writes a spec, starts the system's runner, reads its progress from the
runner's stdout and its result from a file, and summarises every system's records with the same code
(benchmarks.records.summarize).

Runners: ``python -m benchmarks.runner`` (kvserve, Hugging Face, the overhead probe) in this
interpreter; ``<vllm python> benchmarks/vllm_runner.py`` (stdlib and vLLM only) for vLLM. Each gets
OMP_NUM_THREADS = its threads in its environment, and the kvserve / HF runner also calls
``torch.set_num_threads``.

Protocol (``<runner> SPEC.json RESULT.json``)::

    spec   {"system": "kvserve-cache" | "kvserve-nocache" | "hf-static" | "hf-continuous" |
                      "kvserve-overhead" | "vllm-cache" | "vllm-nocache",
            "model": dir, "threads": n,
            "engine": {"enable_prefix_caching", "block_size", "max_num_seqs", "max_num_batched_tokens",
                       "max_model_len", "kv_cache_memory_bytes", "kv_cache_dtype",
                       "cpu_matmul_precision" (kvserve's only)},
            "options": {system-specific: "hf_batch_size", "hf_cb", "num_seqs", "log_stats"},
            "instances": [{"label": "first" | "steady", "workload": Workload.to_dict()}, ...]}
    result {"system", "pid", "start_s" (constructing the system), "torch_threads", "omp_num_threads",
            "versions": {...}, "info": {...}, "import_s" (optional),
            "instances": [{"label", "elapsed_s", "records": [RequestRecord.to_dict() with token_ids],
                           "extra": {figures the system knows about itself}}]}
    stdout lines "@@bench-progress <k>": k more requests finished; any other output is the log.

The runner constructs its system, then runs the instances in order: the first right after
construction (no warm-up request), each later one on the same, now warm, system.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.records import RequestRecord, percentiles, summarize
from benchmarks.runner import PROGRESS
from benchmarks.workloads import Workload

REPO_ROOT = Path(__file__).resolve().parents[1]
VLLM_RUNNER = Path(__file__).with_name("vllm_runner.py")
LOG_LINES = 60  # lines of a failed runner's output shown in the error


class RunnerError(RuntimeError):
    """A runner exited without a result."""


def runner_command(system: str, vllm_python: str | None = None) -> list[str]:
    if system.startswith("vllm-"):
        if not vllm_python:
            raise ValueError(f"{system} needs --vllm-python (the python of a venv with vLLM)")
        return [vllm_python, str(VLLM_RUNNER)]
    return [sys.executable, "-m", "benchmarks.runner"]


def runner_env(system: str, threads: int) -> dict[str, str]:
    """This process's environment with the threads pinned; vLLM's runner runs its engine in-process
    and must not see this repository's packages (its venv has no kvserve)."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    if threads == 0:  # the system's own default (vLLM then picks its threads itself)
        env.pop("OMP_NUM_THREADS")
    env["TOKENIZERS_PARALLELISM"] = "false"
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != REPO_ROOT]
    if system.startswith("vllm-"):
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the spec's kv_cache_memory_bytes decides
        env.pop("VIRTUAL_ENV", None)
    else:
        paths.insert(0, str(REPO_ROOT))
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    else:
        env.pop("PYTHONPATH", None)
    return env


def make_spec(system: str, model: str, threads: int, instances: list[tuple[str, Workload]], engine: dict,
              options: dict | None = None) -> dict:
    return {"system": system, "model": model, "threads": threads, "engine": dict(engine), "options": options or {},
            "instances": [{"label": label, "workload": w.to_dict()} for label, w in instances]}


def run_spec(spec: dict, command: list[str], env: dict[str, str], progress: Callable[[int], None] | None = None,
             timeout_s: float | None = None) -> dict:
    """Run one runner on ``spec``; its result dict (plus "wall_s", the whole process's seconds).
    Raises RunnerError, with the tail of its output, if it fails or outlives ``timeout_s``."""
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as tmp:
        spec_path, result_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        log: collections.deque[str] = collections.deque(maxlen=LOG_LINES)
        start = time.perf_counter()
        proc = subprocess.Popen([*command, spec_path, result_path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, env=env, cwd=tmp, start_new_session=True)
        def kill_group() -> None:  # the runner and anything it started (compile workers)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass

        timer = None
        if timeout_s is not None:
            import threading

            timer = threading.Timer(timeout_s, kill_group)
            timer.start()
        try:
            for line in proc.stdout:
                if line.startswith(PROGRESS):
                    if progress is not None:
                        progress(int(line.split()[1]))
                else:
                    log.append(line.rstrip("\n"))
            returncode = proc.wait()
        finally:
            if timer is not None:
                timer.cancel()
            if proc.poll() is None:
                kill_group()
                proc.wait()
        wall_s = time.perf_counter() - start
        if returncode != 0 or not os.path.exists(result_path):
            reason = "was killed after %.0f s" % wall_s if returncode < 0 else f"exited with {returncode}"
            raise RunnerError(f"{spec['system']} ({' '.join(command)}) {reason}; its last output:\n" + "\n".join(log))
        with open(result_path) as f:
            result = json.load(f)
    result["wall_s"] = wall_s
    return result


def _summary(name: str, instance: dict) -> dict:
    extra = dict(instance.get("extra") or {})
    if isinstance(extra.get("vllm_ttft_s"), list):  # vLLM's own first-token latencies, per request
        extra["vllm_ttft_s"] = percentiles([t for t in extra["vllm_ttft_s"] if t is not None])
    records = [RequestRecord.from_dict(r) for r in instance["records"]]
    return summarize(name, records, instance["elapsed_s"], **extra, token_ids=[r.token_ids or [] for r in records])


def run_from_result(name: str, result: dict) -> dict:
    """A report's run from a runner's result: the last instance (the steady one) at the top level,
    as every other run of the report, and each earlier one under its label (``first``), with the
    process's facts and ``steady_over_first``, the steady instance's output tok/s over the first's."""
    summaries = {inst["label"]: _summary(name, inst) for inst in result["instances"]}
    labels = [inst["label"] for inst in result["instances"]]
    run = summaries[labels[-1]]
    for label in labels[:-1]:
        run[label] = summaries[label]
    first = summaries.get("first")
    run["steady_over_first"] = (run["output_tokens_per_s"] / first["output_tokens_per_s"]
                                if first is not None and first["output_tokens_per_s"] else None)
    run["process"] = {k: result.get(k) for k in ("pid", "start_s", "import_s", "wall_s", "torch_threads",
                                                 "omp_num_threads", "versions")}
    run["start_s"] = result.get("start_s")
    run["pid"] = result.get("pid")
    return run


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of requests whose greedy tokens are identical in both runs."""
    return sum(x == y for x, y in zip(a, b)) / len(a) if a else 0.0


def compare_tokens(runs: list[dict], reference: str = "kvserve-cache") -> None:
    """``same_tokens_as_<reference>`` on every other run and on each of its instances; token ids
    are then dropped from the runs (the report does not keep them)."""
    ref = next((r for r in runs if r["name"] == reference), None)
    key = "same_tokens_as_" + reference.replace("-", "_")
    for run in runs:
        for part, ref_part in [(run, ref), (run.get("first"), ref and ref.get("first"))]:
            if part is None:
                continue
            if ref_part is not None and run is not ref:
                part[key] = agreement(part["token_ids"], ref_part["token_ids"])
    for run in runs:
        run.pop("token_ids", None)
        if run.get("first"):
            run["first"].pop("token_ids", None)
