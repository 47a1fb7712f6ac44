"""`kvserve bench-host-tier` at smoke size on the tiny checkpoint: the command runs the three
configurations (two rounds, taking turns), writes its JSON, and the figures hang together (same
tokens, the tier recovering the unlimited pool's hits, the pool sizes planned from the workload)."""

from __future__ import annotations

import json

from benchmarks.host_tier import conversation_blocks, plan
from benchmarks.workloads import multi_turn
from cluster.cli import main


def test_bench_host_tier_command(model_dirs, tmp_path, capsys):
    model = model_dirs["llama"]
    out = tmp_path / "tier.json"
    assert main(["bench-host-tier", "--model", model, "--users", "4", "--turns", "2", "--output-len", "4",
                 "--attention-backend", "cpu", "--repeat", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    workload = multi_turn(model, num_users=4, num_turns=2, output_len=4)
    total = conversation_blocks(workload, 16)
    assert report["workload"]["conversation_blocks"] == total == 4 * -(-(len(workload.requests[-1].prompt) + 4) // 16)
    runs = report["runs"]
    assert runs["tier-off"]["num_kv_blocks"] == runs["tier-on"]["num_kv_blocks"] == plan(workload, 16, 0.25)["tier-off"]["num_kv_blocks"]
    assert runs["tier-on"]["num_host_kv_blocks"] == total and runs["unlimited-pool"]["num_kv_blocks"] == total + 1
    assert report["same_tokens"] is True
    # two rounds each, the configurations taking turns; each keeps its best
    assert report["workload"]["repeat"] == 2
    for r in runs.values():
        assert len(r["rounds_output_tokens_per_s"]) == 2
        assert r["output_tokens_per_s"] == max(r["rounds_output_tokens_per_s"])
    assert all(r["output_tokens"] == 8 * 4 for r in runs.values())
    # the second turns find their first turn's prompt: in the pool when it holds everything, in the tier
    # when it is on, mostly lost when it is off
    assert runs["tier-on"]["prefix_cache_hits"] == runs["unlimited-pool"]["prefix_cache_hits"] > 0
    assert runs["tier-off"]["prefix_cache_hits"] < runs["tier-on"]["prefix_cache_hits"]
    assert runs["tier-on"]["host_kv_cache_hits"] > 0 and runs["tier-off"]["host_kv_cache_hits"] == 0
    assert report["hit_rate_vs_unlimited"] == 1.0
    assert report["tokens_per_s_vs_off"] == runs["tier-on"]["output_tokens_per_s"] / runs["tier-off"]["output_tokens_per_s"]
    printed = capsys.readouterr().out
    assert "| tier-on |" in printed and "hit rate, tier on / unlimited pool: 1.000" in printed
