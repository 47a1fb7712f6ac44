"""`kvserve bench-pp-transport`: both ways a stage's activations can take to the next, each step's rows
checked on arrival, and the report's table."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.pp_transport import (MODES, add_bench_pp_transport_arguments, bench_pp_transport, format_pp_transport,
                                     run_bench_pp_transport)


def test_both_ways_carry_every_step_and_are_reported(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    report = bench_pp_transport([1, 40], width=96, steps=3, two_nodes=False)
    assert report["nodes"] == 1 and report["width"] == 96
    cells = {(r["mode"], r["rows"]): r for r in report["results"]}
    assert set(cells) == {(mode, rows) for mode in MODES for rows in (1, 40)}
    for cell in cells.values():  # (measure raises if the second stage's checksum differs from what was sent)
        assert 0 < cell["step_ms_min"] <= cell["step_ms_p50"]
        assert cell["first_stage_cpu_ms"] >= 0 and cell["second_stage_cpu_ms"] >= 0
    table = format_pp_transport(report)
    assert "| 40 | 15,360 |" in table and "stages on 1 node(s)" in table


@pytest.mark.parametrize("argv", [["--steps", "1"], ["--rows", "0,4"], ["--rows", "4,x"], ["--width", "0"]])
def test_bad_arguments_are_refused_in_one_sentence(argv):
    parser = argparse.ArgumentParser()
    add_bench_pp_transport_arguments(parser)
    with pytest.raises(SystemExit, match="rows and width must be positive and steps at least 2"):
        run_bench_pp_transport(parser.parse_args(argv))
