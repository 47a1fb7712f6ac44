"""`python -m benchmarks.gemm_peak` and the GFLOP/s-against-peak line of `kvserve profile-step`."""

from __future__ import annotations

import json

from benchmarks import gemm_peak
from benchmarks.profile_step import format_profile
from tests.compiled import cpu_backend_or_skip

cpu_backend_or_skip()


def test_gemm_peak_measures_the_products_against_the_peak(tmp_path, capsys):
    out = tmp_path / "gemm.json"
    assert gemm_peak.main(["--rows", "1,13", "--shapes", "64x128", "--threads", "1,2", "--repeats", "1",
                           "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "FMA peak" in text and "| 64x128 |" in text and "of peak" in text
    result = json.loads(out.read_text())
    assert result["peak_per_core"] > 0 and set(result["peak"]) == {"1", "2"}
    rows = result["products"]
    assert [(r["m"], r["threads"]) for r in rows] == [(1, 1), (1, 2), (13, 1), (13, 2)]
    for r in rows:
        assert r["packed_gflops"] > 0 and r["torch_gflops"] > 0
        assert r["of_peak"] == r["packed_gflops"] / (result["peak_per_core"] * r["threads"])
        assert (r["packed_cpu_gflops"] is None) == (r["threads"] > 1)


def test_profile_step_reports_the_products_against_the_peak():
    result = {"num_seqs": 4, "prompt_len": 8, "shared_prefix": 0, "threads": 2, "attention_backend": "cpu",
              "cascade": True, "step_ms": 10.0, "tokens_per_s": 400.0, "phases_ms": {"forward": 8.0, "logits": 1.0},
              "forward_ops_ms": {"matmul": 5.0, "attention": 2.0}, "matmul_flops": 5e8, "fma_peak_per_core": 100.0}
    text = format_profile(result)
    assert "matrix products: 100.0 GFLOP/s = 50% of the FMA peak (100.0 GFLOP/s per core x 2)" in text
    result["fma_peak_per_core"] = None  # no compiled kernels: the rate alone
    assert format_profile(result).endswith("matrix products: 100.0 GFLOP/s")
