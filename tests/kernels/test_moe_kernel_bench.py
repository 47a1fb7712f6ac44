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
    result = moe_kernel.measure(100, 40, 4, 2, (5,), rounds=1, repeats=1, threads=1)
    assert list(result["batches"][0]["seconds"]) == ["float32"]
    if OPS.amx_usable():
        assert result["split_unavailable"] == ("the split needs a multiple of 32 input features, which neither "
                                               "hidden (100) nor intermediate (40) is")


def test_each_weight_is_split_where_32_divides_its_inputs_as_the_layer_lays_them_out(capsys):
    """FusedMoE.pack_for_cpu splits w13 (inputs: hidden) and w2 (inputs: intermediate) each on its own:
    hidden 96 splits gate|up, intermediate 40 keeps down in float32 panels, and the benchmark times that."""
    if not OPS.amx_usable():
        assert moe_kernel.measure(96, 40, 4, 2, (70,), rounds=1, repeats=1, threads=1)["split_unavailable"]
        return
    result = moe_kernel.measure(96, 40, 4, 2, (70,), rounds=1, repeats=1, threads=1)
    assert result["split"] == [True, False] and list(result["batches"][0]["seconds"]) == ["float32", "bf16x3"]
    assert result["batches"][0]["split_error"] <= moe_kernel.MAX_SPLIT_ERROR
    assert "bf16x3: w2 (down) stays in float32 panels" in moe_kernel.format_table(result)


def test_the_layouts_alternate_which_goes_first(monkeypatch):
    """Round r times float32 then bf16x3 where r is even, the other way round where odd: neither layout
    always runs in the other's wake."""
    calls = []
    monkeypatch.setattr(moe_kernel, "_best", lambda fn, repeats: calls.append(fn) or 1.0)
    result = moe_kernel.measure(96, 64, 4, 2, (5,), rounds=4, repeats=1, threads=1)
    names = list(result["batches"][0]["seconds"])
    if len(names) == 1:  # no AMX tiles: float32 alone, once a round
        assert len(calls) == 4
        return
    first = calls[0]
    order = ["float32" if fn is first else "bf16x3" for fn in calls]
    assert order == ["float32", "bf16x3", "bf16x3", "float32", "float32", "bf16x3", "bf16x3", "float32"]


@pytest.mark.parametrize("args,message", [
    (["--experts", "4", "--top-k", "5"], "--top-k must be between 1 and the 4 experts, not 5"),
    (["--rounds", "0"], "--rounds must be at least 1, not 0"),
    (["--repeats", "0"], "--repeats must be at least 1, not 0"),
    (["--tokens", "0,16"], "--tokens must list batch sizes of at least 1 token"),
])
def test_arguments_out_of_range_are_refused(args, message, capsys):
    with pytest.raises(SystemExit):
        moe_kernel.main(args)
    assert message in capsys.readouterr().err
