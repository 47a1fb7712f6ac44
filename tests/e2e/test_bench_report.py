"""The benchmark report on a synthetic run set: the Markdown tables and speedups, the files
write_report leaves, plots left out when there is nothing to draw, and no matplotlib until plotting."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.records import RequestRecord, summarize
from benchmarks.report import COLUMNS, format_markdown, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOT_FILES = ("throughput.png", "throughput_vs_concurrency.png", "ttft_distribution.png", "hit_rate_over_time.png")


def make_run(name: str, *, num_requests: int, ttft: float, itl: float, gap: float, output_len: int = 16,
             **extra) -> dict:
    """Requests arriving every `gap` s, each streaming `output_len` tokens one `itl` apart after a TTFT
    that grows with the queue."""
    records = []
    for i in range(num_requests):
        record = RequestRecord(prompt_tokens=120 + i, arrival=i * gap)
        at = record.arrival + ttft * (1 + 0.2 * i)
        for _ in range(output_len):
            record.add_tokens(1, at)
            at += itl
        record.end = at - itl
        records.append(record)
    return summarize(name, records, max(r.end for r in records), **extra)


def timeline(duration: float, final_hit_rate: float) -> list[dict]:
    return [{"t": duration * k / 10, "prefix_cache_hit_rate": final_hit_rate * k / 10,
             "kv_cache_usage": min(1.0, 0.15 * k), "num_running": min(8, k)} for k in range(11)]


def synthetic_report() -> dict:
    cache = make_run("kvserve-cache", num_requests=12, ttft=0.02, itl=0.004, gap=0.002, mode="offline",
                     prefix_cache_hit_rate=0.91, kv_cache_usage_peak=0.62, kv_waste_at_peak=0.03,
                     num_preemptions=0, timeline=timeline(0.3, 0.91))
    nocache = make_run("kvserve-nocache", num_requests=12, ttft=0.08, itl=0.006, gap=0.002, mode="offline",
                       prefix_cache_hit_rate=0.0, kv_cache_usage_peak=0.97, kv_waste_at_peak=0.05,
                       num_preemptions=3)
    cache["first"] = make_run("kvserve-cache", num_requests=12, ttft=0.04, itl=0.005, gap=0.002, mode="offline")
    cache.update(start_s=1.5, steady_over_first=cache["output_tokens_per_s"] / cache["first"]["output_tokens_per_s"])
    nocache["first"] = make_run("kvserve-nocache", num_requests=12, ttft=0.08, itl=0.006, gap=0.002, mode="offline",
                                same_tokens_as_kvserve_cache=0.5)
    nocache.update(start_s=1.4, steady_over_first=1.0, same_tokens_as_kvserve_cache=1.0)
    hf = make_run("hf-static-b8", num_requests=12, ttft=0.3, itl=0.02, gap=0.0)
    online = [make_run(f"kvserve-serve-http-c{c}", num_requests=12, ttft=0.02 + 0.01 * c, itl=0.005, gap=0.04 / c,
                       mode="online", concurrency=c, request_rate=None, prefix_cache_hit_rate=0.88)
              for c in (1, 4)]
    online.append(make_run("kvserve-serve-http-r2", num_requests=12, ttft=0.05, itl=0.005, gap=0.5, mode="online",
                           concurrency=None, request_rate=2.0, prefix_cache_hit_rate=None))
    chat_cache = make_run("kvserve-cache", num_requests=8, ttft=0.03, itl=0.005, gap=0.01, mode="offline",
                          prefix_cache_hit_rate=0.64, kv_cache_usage_peak=0.4, timeline=timeline(0.2, 0.64))
    chat_hf = make_run("hf-continuous", num_requests=8, ttft=0.1, itl=0.01, gap=0.01)
    return {
        "command": "kvserve bench --workload shared-system-prompt --workload multi-turn-chat --concurrency 1 4",
        "machine": {"platform": "Linux-x86_64", "cpus": 16, "torch_threads": 8, "torch": "2.5.1", "python": "3.12.3"},
        "model": "/models/llama-small",
        "model_params": 26.7e6,
        "kvserve": {"block_size": 8},
        "settings": {"threads": 8, "max_num_seqs": 256, "max_num_batched_tokens": 2048,
                     "kv_cache_memory_bytes": 2**31, "process": "one fresh process per system and workload"},
        "workloads": {
            "shared-system-prompt": {
                "description": "12 requests: a 488-token system prompt + a short question each",
                "num_requests": 12, "prompt_tokens": cache["prompt_tokens"],
                "runs": [cache, nocache, hf], "online": online,
                "targets": [{"name": "hit rate >= 0.75", "value": 0.91, "target": 0.75, "met": True},
                            {"name": "cache vs nocache >= 5x", "value": 2.4, "target": 5.0, "met": False}],
            },
            "multi-turn-chat": {"description": "8 conversations of growing history", "num_requests": 8,
                                "prompt_tokens": chat_cache["prompt_tokens"], "runs": [chat_cache, chat_hf]},
        },
        "overhead": {"num_running": 64, "step_ms": 80.0, "forward_ms": 76.8, "overhead_fraction": 0.04},
    }


def table_rows(markdown: str) -> dict[str, dict[str, str]]:
    """run name -> column -> cell, over every runs table (the last table wins for a repeated name)."""
    rows = {}
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == len(COLUMNS) and cells[0] != "run":
            rows[cells[0]] = dict(zip(COLUMNS, cells))
    return rows


def test_markdown_tables_speedups_and_dashes():
    report = synthetic_report()
    md = format_markdown(report)
    assert f"`{report['command']}`" in md
    assert "| " + " | ".join(COLUMNS) + " |" in md
    assert "### shared-system-prompt" in md and "### multi-turn-chat" in md
    for section in report["workloads"].values():
        for run in section["runs"] + section.get("online", []):
            assert f"| {run['name']} |" in md
    runs = {r["name"]: r for r in report["workloads"]["shared-system-prompt"]["runs"]}
    for other in ("kvserve-nocache", "hf-static-b8"):
        ratio = runs["kvserve-cache"]["output_tokens_per_s"] / runs[other]["output_tokens_per_s"]
        assert f"kvserve-cache vs {other}: {ratio:.2f}x" in md
    chat = {r["name"]: r for r in report["workloads"]["multi-turn-chat"]["runs"]}
    assert (f"kvserve-cache vs hf-continuous: "
            f"{chat['kvserve-cache']['output_tokens_per_s'] / chat['hf-continuous']['output_tokens_per_s']:.2f}x") in md

    rows = table_rows(md)
    hf = rows["hf-static-b8"]
    assert hf["mode"] == "offline" and hf["conc/rate"] == "-"
    assert [hf[c] for c in ("hit rate", "KV peak", "KV waste", "preempt")] == ["-"] * 4
    assert rows["kvserve-nocache"]["preempt"] == "3" and rows["kvserve-nocache"]["hit rate"] == "0.0%"
    assert rows["kvserve-serve-http-c4"]["conc/rate"] == "c=4" and rows["kvserve-serve-http-c4"]["mode"] == "online"
    assert rows["kvserve-serve-http-r2"]["conc/rate"] == "2 req/s" and rows["kvserve-serve-http-r2"]["hit rate"] == "-"
    assert f"{runs['hf-static-b8']['output_tokens_per_s']:.1f}" == hf["out tok/s"]

    assert "| hit rate >= 0.75 | 0.910 | 0.750 | ✅ |" in md
    assert "| cache vs nocache >= 5x | 2.400 | 5.000 | ❌ |" in md
    assert "64 running sequences: 4.0%" in md
    assert "Settings: 8 threads (OMP_NUM_THREADS and torch), kvserve block size 8" in md
    cache = runs["kvserve-cache"]
    assert (f"| kvserve-cache | 1.5 | {cache['first']['output_tokens_per_s']:.1f} | {cache['output_tokens_per_s']:.1f} "
            f"| {cache['steady_over_first']:.2f} | 80 / 40 | - |") in md
    assert "| kvserve-nocache | 1.4 |" in md and "| 1.00 | 160 / 160 | 50.0% / 100.0% |" in md
    assert "kvserve beside vLLM" not in md


def test_write_report_files(tmp_path):
    report = synthetic_report()
    original = copy.deepcopy(report)
    paths = write_report(report, str(tmp_path / "out"))
    assert report == original  # rendering leaves the report as it was
    with open(paths["json"]) as f:
        assert json.load(f) == json.loads(json.dumps(report))
    with open(paths["markdown"]) as f:
        assert f.read() == format_markdown(report)
    assert [os.path.basename(p) for p in paths["plots"]] == list(PLOT_FILES)
    for path in paths["plots"]:
        with open(path, "rb") as f:
            assert f.read(8) == PNG_MAGIC
        assert os.path.getsize(path) > 1000


def test_plots_left_out_without_online_runs_or_timelines(tmp_path):
    report = synthetic_report()
    for section in report["workloads"].values():
        section.pop("online", None)
        for run in section["runs"]:
            run.pop("timeline", None)
    del report["overhead"], report["model_params"]
    paths = write_report(report, str(tmp_path))
    assert [os.path.basename(p) for p in paths["plots"]] == ["throughput.png", "ttft_distribution.png"]
    assert not (tmp_path / "throughput_vs_concurrency.png").exists()
    assert not (tmp_path / "hit_rate_over_time.png").exists()
    md = format_markdown(report)
    assert "overhead" not in md and "parameters" not in md


def test_report_imports_without_matplotlib():
    code = "import sys, benchmarks.report; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "False"
