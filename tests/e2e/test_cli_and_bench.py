"""The command line and a smoke-sized run of the benchmark (the real one is `make bench`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.cli import bench
from benchmarks.report import format_console
from benchmarks.workloads import WORKLOADS, build_workload

OFFLINE = ["hf-static", "hf-continuous", "kvserve-nocache", "kvserve-cache"]


def test_bench_every_workload_offline(model_dirs):
    """A smoke-sized `kvserve bench` of every workload on every offline system: counts add up,
    rates are rates, the cache hits where prompts repeat, and the tokens agree across systems."""
    report = bench(model_dirs["llama"], workloads=list(WORKLOADS), systems=OFFLINE, scale=0.05, output_len=4,
                   hf_batch_size=2, overhead_seqs=4, progress=False)
    assert set(report["workloads"]) == set(WORKLOADS)
    for name, section in report["workloads"].items():
        workload = build_workload(name, model_dirs["llama"], 0.05, 4)
        wanted = sum(r.output_len for r in workload.requests)
        runs = {run["name"]: run for run in section["runs"]}
        assert set(runs) == {"hf-static-b2", "hf-continuous", "kvserve-nocache", "kvserve-cache"}
        for run in runs.values():
            assert run["num_requests"] == len(workload.requests) and run["num_failed"] == 0
            assert run["output_tokens"] == wanted  # tokens counted = tokens asked for and returned
            assert run["itl_s"]["count"] == wanted - len(workload.requests)
            assert 0 < run["ttft_s"]["p50"] <= run["e2e_s"]["p99"] <= run["elapsed_s"]
            assert run["output_tokens_per_s"] == pytest.approx(wanted / run["elapsed_s"])
            assert "token_ids" not in run
        for name_ in ("kvserve-cache", "kvserve-nocache"):
            run = runs[name_]
            assert 0.0 <= run["prefix_cache_hit_rate"] <= 1.0 and run["num_preemptions"] == 0
            assert 0.0 < run["kv_cache_usage_peak"] <= 1.0 and 0.0 <= run["kv_waste_at_peak"] < 1.0
            assert run["timeline"] and run["timeline"][-1]["t"] <= run["elapsed_s"]
        assert runs["kvserve-nocache"]["prefix_cache_hit_rate"] == 0.0
        assert runs["kvserve-nocache"]["same_tokens_as_kvserve_cache"] == 1.0
        assert runs["hf-static-b2"]["same_tokens_as_kvserve_cache"] >= 0.5  # fp32 greedy; near-ties aside
    shared = {run["name"]: run for run in report["workloads"]["shared-system-prompt"]["runs"]}
    assert shared["kvserve-cache"]["prefix_cache_hit_rate"] > 0.5
    multi = {run["name"]: run for run in report["workloads"]["multi-turn"]["runs"]}
    assert multi["kvserve-cache"]["prefix_cache_hit_rate"] > 0.3  # later turns reuse earlier ones
    targets = {t["name"]: t for t in report["workloads"]["shared-system-prompt"]["targets"]}
    assert targets["prefix hit rate"]["value"] == shared["kvserve-cache"]["prefix_cache_hit_rate"]
    assert "throughput vs hf-continuous (x)" in targets and "step overhead at 4 running" in targets
    assert report["workloads"]["independent"]["targets"] == []
    assert "kvserve-cache vs kvserve-nocache" in format_console(report)


def test_bench_command_writes_json_markdown_and_plots(model_dirs, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "bench", "--model", model_dirs["llama"], "--workload",
         "shared-system-prompt", "--systems", "kvserve-cache", "kvserve-nocache", "--scale", "0.05",
         "--output-len", "3", "--overhead-seqs", "0", "--no-progress", "--out", str(tmp_path / "r")],
        capture_output=True, text=True, timeout=300, check=True)
    assert "| kvserve-cache |" in out.stdout
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["command"].startswith("kvserve bench --model")
    assert (tmp_path / "r" / "report.md").read_text().count("kvserve-nocache") >= 2
    assert (tmp_path / "r" / "throughput.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "r" / "hit_rate_over_time.png").exists()


def test_generate_command(model_dirs):
    out = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "generate", "--model", model_dirs["qwen2"], "--prompt", "Hello there",
         "--max-tokens", "5"], capture_output=True, text=True, timeout=300, check=True,
    )
    assert "--- 'Hello there'" in out.stdout
    assert "tokens in" in out.stdout
