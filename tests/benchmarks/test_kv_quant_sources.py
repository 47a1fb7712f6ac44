"""`kvserve bench-kv-quant --parts sources`: transformers' model with its keys and values rounded as a
quantized pool stores them, part by part, on the tiny llama (head size 16)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.kv_quant import bench_kv_quant, format_kv_quant_report
from benchmarks.kv_quant_sources import VARIANTS, hadamard, rounded
from engine import LLM, SamplingParams


@pytest.mark.parametrize("n", (1, 2, 16, 128, 256))
def test_the_turn_is_orthogonal(n):
    h = hadamard(n)
    assert torch.allclose(h @ h.T, torch.eye(n), atol=1e-6)
    assert torch.allclose(h.abs(), torch.full((n, n), n ** -0.5))


@pytest.mark.parametrize("n", (0, 80, 96, 192))  # head sizes of real models that are no power of two
def test_no_turn_for_other_sizes(n):
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(n)


def test_the_turn_spreads_an_outlier_channel_for_int8():
    """int8's step follows the row's largest value: one channel 50 times the others takes the other
    channels' precision, and the turn gives it back."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=g)
    x[:, 5] *= 50
    plain = (rounded(x, "int8") - x).norm()
    turned = (rounded(x, "int8", hadamard(128)) - x).norm()
    assert turned < 0.3 * plain


def test_the_sources_part_rounds_each_half_and_its_control_nothing(model_dirs):
    model = model_dirs["llama"]
    report = bench_kv_quant(model, formats=("auto", "int8", "fp8_e4m3"), block_size=16, accuracy_requests=4,
                            output_len=4, turns=2, parts=("sources",))
    assert set(report) >= {"sources"} and "accuracy" not in report and "capacity" not in report
    for name, src in report["sources"].items():
        assert (src["sequences"], src["generated_positions"]) == (4, 16), name
        assert set(src["formats"]) == {"int8", "fp8_e4m3"}
        # the control: the continuations are the unrounded model's own argmax of the same forward
        assert src["control_agreement"] == 1.0
        for fmt, variants in src["formats"].items():
            assert tuple(variants) == VARIANTS
            for variant in VARIANTS:
                d = variants[variant]["delta_logprob"]
                assert 0.0 < d["mean"] <= d["p99"] <= d["max"] < 0.5, (name, fmt, variant)
            # each half alone is a part of the whole error, not all of it
            both = variants["keys and values"]["delta_logprob"]["mean"]
            assert variants["keys only"]["delta_logprob"]["mean"] < both
            assert variants["values only"]["delta_logprob"]["mean"] < both
        # fp8_e4m3's three mantissa bits against int8's 127 steps: the larger error, both rounded
        both = {fmt: src["formats"][fmt]["keys and values"]["delta_logprob"]["mean"] for fmt in ("int8", "fp8_e4m3")}
        assert both["fp8_e4m3"] > both["int8"], name
    text = format_kv_quant_report(report)
    assert "| fp8_e4m3 | keys rotated |" in text and "| int8 | values only |" in text


@pytest.mark.parametrize("backend", ("torch", "cpu"))
def test_rounding_keys_and_values_is_what_the_engine_does(model_dirs, backend):
    """The variant that rounds both is the engine's quantized pool, on the plain-torch backend and the
    compiled one: the same logprobs, teacher-forced."""
    from benchmarks.kv_quant import chosen, hf_log_softmax
    from benchmarks.kv_quant_sources import load_model, rounding

    model = model_dirs["llama"]
    hf = load_model(model)
    g = torch.Generator().manual_seed(3)
    sequences = [[1, *torch.randint(3, 200, (n,), generator=g).tolist()] for n in (40, 77)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    for fmt in ("int8", "fp8_e4m3"):
        with LLM(model=model, kv_cache_dtype=fmt, attention_backend=backend, enable_prefix_caching=False) as llm:
            assert llm.stats()["attention_backend"] == backend
            outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params)
        worst = exact_worst = 0.0
        for s, out in zip(sequences, outs):
            with rounding(fmt):
                lp = chosen(hf_log_softmax(hf, s), s)
            with rounding(None):
                exact = chosen(hf_log_softmax(hf, s), s)
            mine = torch.tensor([out.prompt_logprobs[pos][s[pos]][0] for pos in range(1, len(s))])
            worst = max(worst, float((mine - lp).abs().max()))
            exact_worst = max(exact_worst, float((mine - exact).abs().max()))
        assert worst < 1e-4 < exact_worst, (fmt, worst, exact_worst)


def test_a_model_without_an_eager_attention_function_is_refused(monkeypatch, model_dirs):
    import benchmarks.kv_quant_sources as sources

    monkeypatch.setattr(sources, "_eager", lambda module: None)
    with pytest.raises(ValueError, match="no eager attention function"):
        sources.load_model(model_dirs["llama"])
