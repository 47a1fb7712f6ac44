"""The Triton kernels compiled for real NVIDIA targets with no GPU (``kernels.triton.compile_check``, in
a process without the interpreter): every variant of its cover — attention in float16, bfloat16 and
float32 at head sizes 64, 80, 96, 128 and 256, GQA ratios 1-8, block sizes 1, 8, 16 and 32, every
split count (1-32), both tiles, deterministic mode; over quantized pools (fp8 e4m3, fp8 e5m2, int8) at head
sizes 128 and 256 in bfloat16, both tiles, and their stores; the layer ops at the widths of OPT-125m,
Qwen2-0.5B, Llama-3.2-1B, Gemma-2-2B, Phi-2, Phi-3-mini, Qwen2.5-7B and Llama-3-8B; the fused MoE at
Mixtral-8x7B's and Qwen3-30B-A3B's — compiled for
sm_80 and sm_90, none rejected, each within its target's shared memory per block (163 KiB, 227 KiB).
The module's docstring says how the cover is picked from the few thousand distinct variants; here
the report shows that each kind of variant was compiled. About a minute with the two targets
compiling side by side on two cores (two minutes in turn), the Triton cache a fresh one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compile")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp / "cache"), PYTHONPATH=str(ROOT), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-m", "kernels.triton.compile_check", "--parallel", "--out",
                           str(tmp / "report.json")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return json.loads((tmp / "report.json").read_text()), proc


def test_every_variant_compiles_for_sm80_and_sm90_within_shared_memory(report):
    data, proc = report
    assert proc.returncode == 0 and data["errors"] == [], proc.stderr[-4000:]
    n = data["compiled_per_target"]
    assert set(data["per_target"]) == {"sm_80", "sm_90"}
    for target, limit in (("sm_80", 163 * 1024), ("sm_90", 227 * 1024)):
        rows = [r for r in data["results"] if r["target"] == target]
        assert len(rows) == n and data["per_target"][target]["variants"] == n
        assert all(0 <= r["shared"] <= limit and r["cubin_bytes"] > 0 for r in rows)
    times = ", ".join(f"{t} {v['seconds']:.0f} s (max shared {v['max_shared']} B)"
                      for t, v in data["per_target"].items())
    print(f"{data['distinct_variants']} distinct variants, {n} compiled per target: {times}")


def test_the_cover_holds_every_kind_of_variant(report):
    """Each kernel is compiled; attention at every dtype x head size x tile rows and every split count,
    GQA group and block size; the norm at each block width with and without the residual."""
    data, _ = report
    rows = [r for r in data["results"] if r["target"] == "sm_90"]
    by_kernel = {}
    for r in rows:
        by_kernel.setdefault(r["kernel"], []).append(r["constexprs"])
    assert set(by_kernel) == {"_paged_attention_kernel", "_merge_splits_kernel", "_store_kv_kernel",
                              "_rms_norm_kernel", "_rotary_neox_kernel", "_silu_and_mul_kernel", "_linear_kernel",
                              "_fused_moe_kernel"}
    attention = by_kernel["_paged_attention_kernel"]
    assert {c["HEAD_DIM"] for c in attention} == {64, 80, 96, 128, 256}
    assert {c["NUM_SPLITS"] for c in attention} == {1, 2, 4, 8, 16, 32}
    assert {c["GROUP"] for c in attention} == set(range(1, 9))
    assert {c["BLOCK_SIZE"] for c in attention} == {1, 8, 16, 32}
    tiles = {(r["critical"]) for r in rows if r["kernel"] == "_paged_attention_kernel"}
    # dtype x head size x (decode rows, prefill rows); over quantized pools, format x head size x tile (bfloat16)
    assert len(tiles) == 3 * 5 * 2 + 3 * 2 * 2
    quantized = {(c["KV_FORMAT"], c["HEAD_DIM"], c["BLOCK_Q"]) for c in attention if c.get("KV_FORMAT")}
    assert quantized == {(f, d, q) for f in (1, 2, 3) for d, qs in ((128, (4, 16)), (256, (4, 8))) for q in qs}
    assert {(c.get("KV_FORMAT", 0), c["HEAD_DIM"]) for c in by_kernel["_store_kv_kernel"]} >= {
        (f, d) for f in (1, 2, 3) for d in (128, 256)}
    assert {c["NUM_SPLITS"] for c in by_kernel["_merge_splits_kernel"]} == {2, 4, 8, 16, 32}
    assert {(c["BLOCK"], c["HAS_RESIDUAL"]) for c in by_kernel["_rms_norm_kernel"]} == {
        (b, r) for b in (1024, 2048, 4096) for r in (False, True)}
    assert {c["HALF"] for c in by_kernel["_rotary_neox_kernel"]} == {32, 40, 48, 64, 128}
    moe = [r for r in rows if r["kernel"] == "_fused_moe_kernel"]  # gate|up and down in every dtype
    assert {(r["critical"].split(",")[1].strip(), r["constexprs"]["MUL_ROUTED_WEIGHT"]) for r in moe} == {
        (f"'*{t}'", w) for t in ("fp16", "bf16", "fp32") for w in (False, True)}
    print(f"fused MoE: {len(moe)} variants per target, {sum(r['seconds'] for r in moe):.1f} s on sm_90")
    assert data["distinct_variants"] > 10 * data["compiled_per_target"]
