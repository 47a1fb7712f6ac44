"""The command line and a smoke-sized run of the benchmark (the real one is `make bench`)."""

from __future__ import annotations

import subprocess
import sys

from benchmarks.cli import bench, format_report


def test_bench_smoke(model_dirs):
    report = bench(model_dirs["llama"], num_requests=6, prefix_len=48, suffix_len=8, output_len=4,
                   hf_batch_size=4, overhead_seqs=4)
    runs = {run["name"]: run for run in report["runs"]}
    assert set(runs) == {"kvserve-cache", "kvserve-nocache", "hf-static-b4"}
    for run in runs.values():
        assert run["output_tokens"] == 6 * 4  # tokens counted = tokens returned
        assert run["elapsed_s"] > 0 and run["output_tokens_per_s"] > 0
    cache = runs["kvserve-cache"]
    assert 0.0 <= cache["prefix_cache_hit_rate"] <= 1.0
    # 5 of 6 requests reuse the 48-token prefix (3 blocks of 16)
    assert cache["prefix_cache_hits"] == 5 * 48
    assert cache["prefix_cache_queries"] == report["workload"]["prompt_tokens"]
    assert runs["kvserve-nocache"]["prefix_cache_hit_rate"] == 0.0
    assert report["same_tokens_cache_on_off"] is True
    overhead = report["overhead"]
    assert overhead["num_running"] == 4 and 0.0 <= overhead["overhead_fraction"] < 1.0
    assert overhead["forward_ms"] <= overhead["step_ms"]
    text = format_report(report)
    assert "kvserve-cache" in text and "caching on / HF static" in text


def test_generate_command(model_dirs):
    out = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "generate", "--model", model_dirs["qwen2"], "--prompt", "Hello there",
         "--max-tokens", "5"], capture_output=True, text=True, timeout=300, check=True,
    )
    assert "--- 'Hello there'" in out.stdout
    assert "tokens in" in out.stdout
