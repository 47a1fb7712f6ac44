"""`kvserve bench-kv-quant` at smoke size on the tiny llama (head size 16: a quantized row is 18 bytes
against 64 in float32)."""

from __future__ import annotations

import pytest

from benchmarks.kv_quant import bench_kv_quant, format_kv_quant_report


def test_bench_kv_quant_smoke(model_dirs):
    model = model_dirs["llama"]
    report = bench_kv_quant(model, formats=("auto", "int8"), block_size=16, hf=True, kv_gib=0.004, capacity_len=128,
                            pool_share=0.25, repeat=1, users=4, turns=2, output_len=4, accuracy_requests=4,
                            attention_backend="torch")
    for name, acc in report["accuracy"].items():
        auto, int8 = acc["formats"]["auto"], acc["formats"]["int8"]
        assert (acc["sequences"], acc["generated_positions"]) == (4, 16), name  # 4 requests x 4 tokens out
        assert auto["delta_logprob_vs_hf"]["max"] < 1e-4  # the engine in float32 against transformers
        # auto is within 1e-4 of transformers, so int8's error against either is the same to that
        for stat in ("mean", "p99", "max"):
            assert int8["delta_logprob_vs_hf"][stat] == pytest.approx(int8["delta_logprob_vs_auto"][stat], abs=1e-4)
        by_margin = int8["greedy_agreement_by_margin"]
        assert by_margin["0.0"] == int8["greedy_agreement"]
        assert 0.0 < int8["delta_logprob_vs_auto"]["mean"] <= int8["delta_logprob_vs_auto"]["p99"] \
            <= int8["delta_logprob_vs_auto"]["max"] < 0.1
    cap = report["capacity"]["formats"]
    pool = int(0.004 * 2**30)
    assert cap["auto"]["kv_bytes_per_block"] == 2 * 2 * 16 * 2 * 64  # layers x K/V x tokens x heads x row
    assert cap["int8"]["kv_bytes_per_block"] == 2 * 2 * 16 * 2 * 18
    for c in cap.values():
        assert c["num_kv_blocks"] == pool // c["kv_bytes_per_block"] - 1
        assert c["most_sequences"] == c["num_kv_blocks"] // 8
    assert cap["int8"]["blocks_vs_auto"] > 3.5
    runs = report["speed"]["runs"]
    assert runs["int8"]["pool_blocks"] > 3 * runs["auto"]["pool_blocks"]
    assert runs["int8"]["prefix_cache_hit_rate"] >= runs["auto"]["prefix_cache_hit_rate"]
    text = format_kv_quant_report(report)
    assert "| int8 |" in text and "sequences at once" in text
