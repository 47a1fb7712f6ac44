"""`python -m benchmarks.attention_op`: the compiled attention op alone, checked against the reference
before it is timed, with its rates computed from the step's own sizes."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import attention_op
from tests.compiled import cpu_backend_or_skip

cpu_backend_or_skip()


def test_decodes_of_every_format_report_the_pool_bytes_they_read(tmp_path, capsys):
    out = tmp_path / "attn.json"
    assert attention_op.main(["--seqs", "3", "--context", "41", "--layers", "2", "--heads", "6", "--kv-heads", "2",
                              "--head-dim", "48", "--block-size", "16", "--threads", "1,3", "--repeats", "2",
                              "--formats", "auto,int8,fp8_e4m3", "--read-gib", "0.02", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["format"], r["threads"]) for r in result["runs"]] == [
        ("auto", 1), ("auto", 3), ("int8", 1), ("int8", 3), ("fp8_e4m3", 1), ("fp8_e4m3", 3)]
    for run in result["runs"]:
        assert run["max_error"] <= attention_op.MAX_ERROR
        assert 0 < run["best_ms"] <= run["median_ms"]
        # K and V of 3 x 41 keys, 2 KV heads, 2 layers: float32 rows of 48, or 48 codes and a 2-byte scale
        row = 48 * 4 if run["format"] == "auto" else 48 + 2
        assert run["gbps"] == pytest.approx(2 * 2 * 3 * 41 * 2 * row / (run["best_ms"] / 1e3) / 1e9)
    assert set(result["read_gbps"]) == {"1", "3"} and min(result["read_gbps"].values()) > 0
    text = capsys.readouterr().out
    assert "decode: 3 sequences x 41 keys, 2 layers, 6 heads / 2 KV heads of 48, blocks of 16" in text
    assert "| int8 | 3 |" in text and "memory read rate (torch sum of 0.02 GiB)" in text


def test_prefills_report_the_causal_products_flops():
    torch.set_num_threads(1)
    result = attention_op.measure("prefill", ["auto"], [2], seqs=2, context=37, layers=1, heads=4, kv_heads=1,
                                  head_dim=32, block_size=8, repeats=1, shuffle=True, read_gib=0.02)
    (run,) = result["runs"]
    assert run["max_error"] <= attention_op.MAX_ERROR
    assert torch.get_num_threads() == 1  # the caller's threads back
    pairs = 37 * 38 // 2  # each of the 37 query tokens sees itself and the keys before it
    assert run["gflops"] == pytest.approx(4 * 32 * 4 * pairs * 2 / (run["best_ms"] / 1e3) / 1e9)


def test_a_wrong_output_stops_the_run(monkeypatch):
    # the last sequence's rows wrong: every sequence is checked, not only the first
    right = attention_op.Step.run

    def run(self, layer):
        out = right(self, layer).clone()
        out[-1] += 1e-3
        return out

    monkeypatch.setattr(attention_op.Step, "run", run)
    with pytest.raises(RuntimeError, match=r"the op's output is .* from the reference \(auto, 1 threads\)"):
        attention_op.measure("decode", ["auto"], [1], seqs=3, context=9, layers=1, heads=2, kv_heads=1,
                             head_dim=16, block_size=8, repeats=1, shuffle=False, read_gib=0.01)


@pytest.mark.parametrize("argv, message", [
    (["--formats", "fp16"], "--formats takes auto, fp8_e4m3, fp8_e5m2, int8, not fp16"),
    (["--heads", "6", "--kv-heads", "4"], "--heads (6) must be a multiple of --kv-heads (4)"),
    (["--threads", "0"], "--threads must list thread counts of at least 1"),
    (["--context", "0"], "--context must be at least 1, not 0"),
    (["--read-gib", "0"], "--read-gib must be above 0, not 0"),
])
def test_bad_arguments_are_refused_in_one_sentence(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        attention_op.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
