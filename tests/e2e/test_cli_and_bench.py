"""The command line and a smoke-sized `kvserve bench` through it (the real one is `make bench`; the
fresh-process bench itself is tested in tests/benchmarks)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_command_writes_json_markdown_and_plots(model_dirs, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "bench", "--model", model_dirs["llama"], "--workload",
         "shared-system-prompt", "--systems", "kvserve-cache", "kvserve-nocache", "--scale", "0.05",
         "--output-len", "3", "--overhead-seqs", "0", "--no-progress", "--out", str(tmp_path / "r")],
        capture_output=True, text=True, timeout=300, check=True)
    assert "| kvserve-cache |" in out.stdout
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["command"].startswith("kvserve bench --model")
    runs = report["workloads"]["shared-system-prompt"]["runs"]
    assert [r["name"] for r in runs] == ["kvserve-nocache", "kvserve-cache"]
    assert all(r["first"]["output_tokens"] == r["output_tokens"] > 0 for r in runs)
    assert "| kvserve-cache | " in out.stdout and "steady/first" in out.stdout
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
