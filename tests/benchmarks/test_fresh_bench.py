"""`kvserve bench` at smoke size, every system in a fresh process: both instances reported, the
processes really separate and pinned to the same threads, kvserve's tokens the same with the cache on
and off (and the HF peers'), a cold prefix cache for the steady instance, and the report tables and
targets built from them."""

from __future__ import annotations

import os

import pytest

from benchmarks.cli import bench
from benchmarks.report import format_markdown
from benchmarks.workloads import build_workload

SYSTEMS = ["hf-static", "hf-continuous", "kvserve-nocache", "kvserve-cache"]
SCALE, OUTPUT_LEN = 0.0625, 4  # 4 requests
SMALL_CB = dict(page_size=16, num_blocks=64, max_batch_tokens=256)  # HF's default cache takes seconds to allocate
SMALL = dict(scale=SCALE, output_len=OUTPUT_LEN, hf_batch_size=2, hf_cb=SMALL_CB, kv_cache_gib=0.0625, progress=False)


@pytest.fixture(scope="module")
def report(model_dirs):
    """Every offline system on the shared system prompt, kvserve's two on `varied` (7 processes)."""
    shared = bench(model_dirs["llama"], workloads=["shared-system-prompt"], systems=SYSTEMS, overhead_seqs=4, **SMALL)
    varied = bench(model_dirs["llama"], workloads=["varied"], systems=SYSTEMS[2:], overhead_seqs=0, **SMALL)
    shared["workloads"].update(varied["workloads"])
    return shared


def instances(model_dir: str, name: str):
    return [build_workload(name, model_dir, SCALE, OUTPUT_LEN, variant=v) for v in (0, 1)]


@pytest.mark.parametrize("name", ["shared-system-prompt", "varied"])
def test_first_and_steady_instances(report, model_dirs, name):
    section = report["workloads"][name]
    first_w, steady_w = instances(model_dirs["llama"], name)
    assert section["max_model_len"] == max(first_w.max_len, steady_w.max_len)
    runs = {run["name"]: run for run in section["runs"]}
    assert list(runs) == (["hf-static-b2", "hf-continuous"] if name == "shared-system-prompt" else []) + SYSTEMS[2:]
    for run in runs.values():
        for part, workload in ((run["first"], first_w), (run, steady_w)):
            assert part["num_requests"] == len(workload.requests) and part["num_failed"] == 0
            assert part["prompt_tokens"] == workload.num_prompt_tokens
            assert part["output_tokens"] == sum(r.output_len for r in workload.requests)
            assert 0 < part["ttft_s"]["p50"] <= part["e2e_s"]["p99"] <= part["elapsed_s"]
            assert "token_ids" not in part
        assert run["steady_over_first"] == pytest.approx(
            run["output_tokens_per_s"] / run["first"]["output_tokens_per_s"])
        assert run["start_s"] > 0
    assert runs["kvserve-nocache"]["same_tokens_as_kvserve_cache"] == 1.0
    assert runs["kvserve-nocache"]["first"]["same_tokens_as_kvserve_cache"] == 1.0
    for peer in ("hf-static-b2", "hf-continuous"):
        if peer in runs:  # fp32 greedy: the same tokens, near-ties aside
            assert runs[peer]["first"]["same_tokens_as_kvserve_cache"] >= 0.5
            assert runs[peer]["same_tokens_as_kvserve_cache"] >= 0.5
    targets = {t["name"]: t for t in section["targets"]}
    assert targets["kvserve-cache steady / first tok/s"]["value"] == runs["kvserve-cache"]["steady_over_first"]
    assert targets["kvserve-cache steady / first tok/s"]["target"] == 1.2


def test_each_system_and_workload_in_a_process_of_its_own(report):
    processes = [run["process"] for section in report["workloads"].values() for run in section["runs"]]
    pids = [p["pid"] for p in processes] + [report["overhead"]["pid"]]
    assert len(set(pids)) == len(pids) == 7 and os.getpid() not in pids
    for p in processes:
        assert p["torch_threads"] == 2 and p["omp_num_threads"] == "2"
        assert p["wall_s"] >= p["start_s"] > 0


def test_prefix_cache_starts_cold_in_the_steady_instance(report):
    """The steady instance has its own system prompt: it hits its own prompt exactly as often as the
    first instance hit the first's, nothing from the first."""
    cache = next(r for r in report["workloads"]["shared-system-prompt"]["runs"] if r["name"] == "kvserve-cache")
    assert cache["first"]["prefix_cache_hits"] > 0
    assert cache["prefix_cache_hits"] == cache["first"]["prefix_cache_hits"]
    assert cache["prefix_cache_queries"] == cache["first"]["prefix_cache_queries"]
    varied = next(r for r in report["workloads"]["varied"]["runs"] if r["name"] == "kvserve-cache")
    assert varied["prefix_cache_hits"] == varied["first"]["prefix_cache_hits"] == 0


def test_report_shows_both_instances(report):
    md = format_markdown(report)
    assert "First instance (right after the system was built, no warm-up)" in md
    assert md.count("| kvserve-cache | ") >= 4  # runs table and instances table, two workloads
    assert "one fresh process per system and workload" in md
    assert "kvserve beside vLLM" not in md  # no vLLM run


def test_other_workloads_on_kvserve(model_dirs):
    """multi-turn, independent and mixed through the kvserve-cache runner: counts, turns that wait for
    the turn before, and a cache that pays off only where prompts repeat."""
    report = bench(model_dirs["llama"], workloads=["multi-turn", "independent", "mixed"], systems=["kvserve-cache"],
                   overhead_seqs=0, **SMALL)
    for name, section in report["workloads"].items():
        (run,) = section["runs"]
        for part, w in zip((run["first"], run), instances(model_dirs["llama"], name)):
            assert part["num_failed"] == 0 and part["output_tokens"] == sum(r.output_len for r in w.requests)
            assert part["num_preemptions"] == 0 and 0.0 < part["kv_cache_usage_peak"] <= 1.0
            assert part["timeline"] and part["timeline"][-1]["t"] <= part["elapsed_s"]
    multi = report["workloads"]["multi-turn"]["runs"][0]
    assert multi["first"]["prefix_cache_hit_rate"] > 0.3 and multi["prefix_cache_hit_rate"] > 0.3  # later turns
    assert report["workloads"]["independent"]["runs"][0]["prefix_cache_hits"] == 0


def test_the_deterministic_system_is_opt_in_and_runs_with_the_cache(model_dirs):
    """kvserve-deterministic (prefix caching on, batch-invariant numerics) runs only when named."""
    report = bench(model_dirs["llama"], workloads=["shared-system-prompt"], systems=["kvserve-deterministic"],
                   overhead_seqs=0, **SMALL)
    (run,) = report["workloads"]["shared-system-prompt"]["runs"]
    assert run["name"] == "kvserve-deterministic" and run["deterministic"] is True
    assert run["num_failed"] == 0 and run["prefix_cache_hits"] > 0
