"""`kvserve bench-structured` at smoke size: both runs make the same tokens, the constrained ones are
valid objects, the compile times are those of new schemas, the report says so."""

from __future__ import annotations

import argparse

from benchmarks.structured import SCHEMA, add_bench_structured_arguments, bench_structured, format_result


def args_for(model_dir: str, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_structured_arguments(parser)
    return parser.parse_args(["--model", model_dir, "--num-requests", "6", "--prompt-len", "24", "--max-tokens",
                              "48", "--rounds", "1", "--compiles", "2", "--threads", "1", *extra])


def test_structured_bench_compares_the_same_tokens(model_dirs):
    assert len(SCHEMA["properties"]) == 10 == len(SCHEMA["required"])
    result = bench_structured(args_for(model_dirs["llama"]))
    (round_,) = result["throughput"]["rounds"]
    assert 6 <= round_["output_tokens"] <= 6 * 48
    assert round_["constrained_tok_s"] > 0 and round_["unconstrained_tok_s"] > 0
    assert round_["ratio"] == round_["constrained_tok_s"] / round_["unconstrained_tok_s"]
    compile_ = result["compile"]
    assert compile_["count"] == 2 and 0 < compile_["median_s"] <= compile_["max_s"]
    text = format_result(result)
    assert "compile a new 10-field schema" in text and "constrained / unconstrained: median" in text


def test_unconstrained_only_runs_fixed_lengths(model_dirs):
    result = bench_structured(args_for(model_dirs["llama"], "--unconstrained-only", "--output-len", "5"))
    assert [r["output_tokens"] for r in result["unconstrained"]["rounds"]] == [30]
    assert "compile" not in result and "unconstrained: best" in format_result(result)
