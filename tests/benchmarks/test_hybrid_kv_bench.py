"""`kvserve bench-hybrid-kv` at smoke size, on the tiny Gemma 3 (six layers: five window layers of 40
tokens, one full; a hybrid page holds one layer, a plain block six)."""

from __future__ import annotations

import argparse

from benchmarks.hybrid_kv import add_bench_hybrid_kv_arguments, run
from tests.gemma_models import gemma_dir


def test_bench_hybrid_kv_smoke(tmp_path):
    parser = argparse.ArgumentParser()
    add_bench_hybrid_kv_arguments(parser)
    args = parser.parse_args(["--model", gemma_dir("gemma3"), "--seq-len", "256", "--max-tokens", "4",
                              "--block-size", "16", "--kv-gib", "0.002", "--num-seqs", "6", "--decode-tokens", "48",
                              "--work-dir", str(tmp_path)])
    report = run(args)
    assert report["same_greedy_tokens"]
    seq = {r["layout"]: r for r in report["per_sequence"]}
    # measured after the last step but one: 256 + 4 - 3 = 257 tokens computed when it was planned, 258 after
    # it: 17 blocks. The window (40) reaches back to position 218, block 13: 5 window groups x 4 blocks
    assert (seq["plain"]["pages_held"], seq["plain"]["window_groups"]) == (17, 0)
    assert (seq["hybrid"]["pages_held"], seq["hybrid"]["window_groups"]) == (17 + 5 * (17 - 13), 5)
    # a plain block holds all six layers, a hybrid page one: the same bytes per layer-block
    assert seq["plain"]["bytes_per_page"] == 6 * seq["hybrid"]["bytes_per_page"]
    assert report["held_ratio"] == 37 / (6 * 17)
    # the prefill step holds a window page for each of its 16 blocks in each group (no release mid-step)
    assert seq["hybrid"]["peak_pages"] == 16 * 6
    cap = {r["layout"]: r for r in report["capacity"]}
    pool_bytes = int(0.002 * 2**30)
    assert cap["plain"]["pages"] == pool_bytes // seq["plain"]["bytes_per_page"]
    assert cap["hybrid"]["pages"] == pool_bytes // seq["hybrid"]["bytes_per_page"]
    # decoding, a sequence holds at most its 19 blocks (256 + 48 tokens) and 5 x 4 window pages
    assert cap["plain"]["pages_per_decoding_sequence"] == 19
    assert cap["hybrid"]["pages_per_decoding_sequence"] <= 19 + 5 * 4
    assert cap["hybrid"]["most_running"] > cap["plain"]["most_running"] >= 1
