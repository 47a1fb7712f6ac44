"""`python -m benchmarks.moe_kernel`: the experts op with float32 and split weights, taking turns."""

from __future__ import annotations

import json

import pytest

from benchmarks import moe_kernel
from kernels.cpu import load
from tests.compiled import cpu_backend_or_skip

cpu_backend_or_skip()
OPS = load()


def test_the_layouts_take_turns_and_the_split_is_checked_against_float32(tmp_path, capsys):
    out = tmp_path / "moe.json"
    assert moe_kernel.main(["--hidden", "96", "--intermediate", "64", "--experts", "4", "--top-k", "2",
                            "--tokens", "5,70", "--rounds", "3", "--repeats", "1", "--threads", "2",
                            "--json", str(out)]) == 0
    text = capsys.readouterr().out
    result = json.loads(out.read_text())
    split = bool(OPS.amx_usable())
    layouts = ["float32", "bf16x3"] if split else ["float32"]
    assert [b["tokens"] for b in result["batches"]] == [5, 70]
    for b in result["batches"]:
        assert sum(b["rows_per_expert"]) == b["tokens"] * 2  # every token's two experts
        assert list(b["seconds"]) == layouts
        assert all(len(times) == 3 and min(times) > 0 for times in b["seconds"].values())
        assert ("split_error" in b) == split
        if split:
            assert b["split_error"] <= moe_kernel.MAX_SPLIT_ERROR
    assert "| 5 |" in text and "| 70 |" in text
    assert ("float32 / bf16x3" in text) == split
    assert ("bf16x3 not timed: the bf16x3 product needs AMX tiles" in text) == (not split)


def test_a_split_beyond_the_bound_stops_the_run(monkeypatch):
    if not OPS.amx_usable():
        # nothing is split without AMX tiles: the check has nothing to compare, and the run says why
        result = moe_kernel.measure(96, 64, 4, 2, (5,), rounds=1, repeats=1, threads=1)
        assert result["split_unavailable"].startswith("the bf16x3 product needs AMX tiles")
        return
    monkeypatch.setattr(moe_kernel, "MAX_SPLIT_ERROR", 0.0)
    with pytest.raises(RuntimeError, match=r"the split experts' output is .* from the float32 one's at 70 tokens"):
        moe_kernel.measure(96, 64, 4, 2, (70,), rounds=1, repeats=1, threads=1)


def test_widths_the_split_cannot_take_are_timed_in_float32_and_named():
    result = moe_kernel.measure(96, 40, 4, 2, (5,), rounds=1, repeats=1, threads=1)
    assert list(result["batches"][0]["seconds"]) == ["float32"]
    if OPS.amx_usable():
        assert result["split_unavailable"] == ("the split needs a multiple of 32 input features "
                                               "(hidden 96, intermediate 40)")


def test_a_top_k_beyond_the_experts_is_refused(capsys):
    with pytest.raises(SystemExit):
        moe_kernel.main(["--experts", "4", "--top-k", "5"])
    assert "--top-k must be between 1 and the 4 experts, not 5" in capsys.readouterr().err
