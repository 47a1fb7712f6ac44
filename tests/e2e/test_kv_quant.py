"""Quantized KV pools (``kv_cache_dtype``) through the whole engine: the pool's size in blocks, teacher
forcing against Hugging Face within each format's measured error, prefix-cache hits and the host tier
giving what a fresh computation gives, the format in stats and /metrics, and the setting refused where
it is wrong."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from api.metrics import prometheus_text
from engine import LLM, SamplingParams
from kernels.kv_quant import dequantize, quantize
from serve_app import AppArgs, build_app
from tests.e2e.prompts import test_prompts as make_prompts
from workers.kv_pool import KVPoolSpec

ARCH = "llama"
FORMATS = ("fp8_e4m3", "fp8_e5m2", "int8")
BACKENDS = ("torch", "cpu")
# The largest |logprob - HF's| of a scored token: `kvserve bench-kv-quant --model <llama tiny>
# --parts accuracy --accuracy-requests 8 --output-len 16` measured 0.188 (fp8_e4m3), 0.353 (fp8_e5m2)
# and 0.041 (int8) over 6,196 positions on this checkpoint; the bound is 1.5x that. auto stays at
# the engine's float32 agreement with HF.
TOL = {"auto": 1e-4, "fp8_e4m3": 0.28, "fp8_e5m2": 0.53, "int8": 0.062}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(model_dirs) -> str:
    return model_dirs[ARCH]


@pytest.fixture(scope="module")
def prompts(llama) -> list[list[int]]:
    return make_prompts(llama)[1:6]  # 7 to 500 tokens; two share 300


def test_rows_are_quantized_alone_and_round_trip_within_half_a_step():
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 4, 128, generator=gen) * torch.logspace(-3, 3, 64)[:, None, None]
    rows[0, 0] = 0.0
    for fmt in FORMATS:
        codes = quantize(rows, fmt)
        assert codes.dtype == torch.uint8 and codes.shape == (64, 4, 130)
        assert torch.equal(quantize(rows[5:9], fmt), codes[5:9])  # a row's bytes depend on that row alone
        back = dequantize(codes, fmt)
        assert torch.equal(back[0, 0], torch.zeros(128))
        amax = rows.abs().amax(-1, keepdim=True)
        # int8: half a step of amax / 127 (the scale rounded to bfloat16 moves it by up to 2^-9); fp8:
        # half a spacing of the value's code (3 mantissa bits e4m3, 2 e5m2: 2^-4, 2^-3 of it), or, below
        # the smallest normal code, half the smallest subnormal's (2^-10, 2^-17 in code units)
        rel, floor = {"int8": (0.0, 0.0), "fp8_e4m3": (2**-4, 2**-10), "fp8_e5m2": (2**-3, 2**-17)}[fmt]
        scale = quantize(rows, fmt)[..., -2:].contiguous().view(torch.bfloat16).float()
        step = amax / 127 * 0.51 if fmt == "int8" else torch.maximum(rows.abs() * rel, scale * floor)
        assert bool(((back - rows).abs() <= step * 1.01 + 1e-30).all()), fmt


def test_bytes_per_block_and_blocks_in_equal_memory(llama):
    for dtype, auto_bytes in ((torch.bfloat16, 256), (torch.float32, 512)):
        specs = {fmt: KVPoolSpec(2, 4, 128, 16, dtype, kv_format=fmt) for fmt in ("auto", *FORMATS)}
        assert specs["auto"].bytes_per_block == 2 * 2 * 16 * 4 * auto_bytes
        for fmt in FORMATS:
            assert specs[fmt].bytes_per_block == 2 * 2 * 16 * 4 * 130
            assert specs[fmt].num_blocks_for(2**30) / specs["auto"].num_blocks_for(2**30) >= (
                1.9 if dtype == torch.bfloat16 else 3.8)
    budget = 8 * 2**20
    blocks = {}
    for fmt in ("auto", "int8"):
        with LLM(model=llama, kv_cache_dtype=fmt, kv_cache_memory_bytes=budget, attention_backend="torch") as llm:
            stats = llm.stats()
        assert stats["kv_cache_dtype"] == fmt
        blocks[fmt] = stats["num_kv_blocks"]
        assert blocks[fmt] == budget // stats["kv_bytes_per_block_per_rank"]
    # the tiny llama's head size is 16: 18 bytes a row against 64 in float32
    assert blocks["int8"] == budget // (2 * 2 * 16 * 2 * 18)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ("auto", *FORMATS))
def test_teacher_forced_logprobs_stay_within_the_measured_error(llama, prompts, hf_oracle, backend, fmt):
    """Every prompt position's logprob of its token (prompt_logprobs, one prefill, then in 64-token
    chunks) within the format's bound of HF's."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    worst = 0.0
    for chunk in (2048, 64):
        with LLM(model=llama, kv_cache_dtype=fmt, attention_backend=backend, block_size=16,
                 max_num_batched_tokens=chunk, enable_prefix_caching=False) as llm:
            assert llm.stats()["attention_backend"] == backend
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        for prompt, out in zip(prompts, outs):
            ref = hf_oracle(ARCH).log_softmax(prompt)
            for pos in range(1, len(prompt)):
                worst = max(worst, abs(out.prompt_logprobs[pos][prompt[pos]][0] - float(ref[pos - 1, prompt[pos]])))
    assert worst <= TOL[fmt]
    if fmt != "auto":
        assert worst > TOL["auto"]  # the pool really was quantized


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prefix_hit_and_preemption_give_the_tokens_of_a_fresh_computation(llama, prompts, backend):
    """Attention reads every key as stored, the chunk's own included: a request whose prefix comes
    from the cache, or that was preempted and recomputed, gets the tokens it gets computed afresh."""
    fmt = "int8"
    with LLM(model=llama, kv_cache_dtype=fmt, attention_backend=backend, block_size=16,
             enable_prefix_caching=False) as llm:
        fresh = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    with LLM(model=llama, kv_cache_dtype=fmt, attention_backend=backend, block_size=16, num_kv_blocks=40,
             max_num_batched_tokens=64, max_model_len=520) as llm:
        shared = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        again = llm.generate({"prompt_token_ids": prompts[3]}, GREEDY)[0]
        stats = llm.stats()
    assert [o.outputs[0].token_ids for o in shared] == fresh
    assert again.num_cached_tokens >= 16 and again.outputs[0].token_ids == fresh[3]
    assert stats["num_preemptions"] > 0 and stats["num_blocks_in_use"] == 0


def test_the_host_tier_holds_the_quantized_bytes(llama, prompts):
    """The tier holds uint8 rows of head_dim + 2 bytes; a prompt whose blocks were evicted to it and
    restored gets the first run's tokens."""
    with LLM(model=llama, kv_cache_dtype="fp8_e4m3", attention_backend="cpu", block_size=16, num_kv_blocks=24,
             max_model_len=352, num_host_kv_blocks=64) as llm:
        first = llm.generate({"prompt_token_ids": prompts[3]}, GREEDY)[0].outputs[0].token_ids
        llm.generate({"prompt_token_ids": prompts[4][-330:]}, GREEDY)  # evicts the first prompt's blocks
        tier = llm.core.executor.worker.host_tier
        assert tier.buffer.dtype == torch.uint8 and tier.buffer.shape[-1] == 16 + 2
        again = llm.generate({"prompt_token_ids": prompts[3]}, GREEDY)[0]
        stats = llm.stats()
    assert stats["host_kv_cache_hit_blocks"] > 0 and again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first


def test_the_format_is_in_metrics():
    stats = {"kv_cache_dtype": "fp8_e5m2", "num_kv_blocks": 100, "kv_bytes_per_block_per_rank": 4608}
    text = prometheus_text({"r1": stats}, "m")
    assert 'kvserve:cache_config_info{kv_cache_dtype="fp8_e5m2",model_name="m",replica="r1"} 1.0' in text
    assert 'kvserve:kv_cache_block_bytes{model_name="m",replica="r1"} 4608.0' in text
    assert 'kvserve:kv_cache_blocks{model_name="m",replica="r1"} 100.0' in text


def test_the_setting_is_checked(llama, monkeypatch):
    from typing import get_args

    from engine.config import KV_CACHE_DTYPES as ENGINE_NAMES
    from kernels.kv_quant import KV_CACHE_DTYPES
    from kernels.torch_attention import TorchAttentionBackend

    # the torch-free engine, the app's arguments and the kernels name the same formats
    assert get_args(AppArgs.model_fields["kv_cache_dtype"].annotation) == ENGINE_NAMES == KV_CACHE_DTYPES
    assert AppArgs.model_validate({"kv_cache_dtype": "fp8"}).kv_cache_dtype == "fp8"
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        AppArgs.model_validate({"kv_cache_dtype": "fp4"})
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2, int8, got 'nf4'"):
        LLM(model=llama, kv_cache_dtype="nf4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        build_app({"model": llama, "engine_kwargs": {"kv_cache_dtype": "fp4"}})
    # a backend that cannot read a quantized pool refuses it at start, in one sentence
    monkeypatch.setattr(TorchAttentionBackend, "supports_quantized_kv", False)
    with pytest.raises(ValueError, match="^kv_cache_dtype 'int8' is not supported by the torch attention backend$"):
        LLM(model=llama, attention_backend="torch", kv_cache_dtype="int8")


@pytest.mark.parametrize("fmt", ("fp8_e4m3", "int8"))
def test_deterministic_mode_stays_bitwise_invariant(llama, fmt):
    """With ``deterministic=True`` and a quantized pool, a greedy request's tokens and logprobs are the
    same to the bit alone, among 24 others in 32-token chunks, and with its prefix from the cache:
    a token's stored bytes depend on that token alone."""
    from tests.e2e.test_deterministic import run_with_others, target_prompt

    prompt = target_prompt()
    settings = dict(model=llama, attention_backend="cpu", deterministic=True, kv_cache_dtype=fmt)
    with LLM(**settings, enable_prefix_caching=False) as llm:
        alone, _ = run_with_others(llm, prompt, 0, 0)
    with LLM(**settings, max_num_batched_tokens=32) as llm:
        assert run_with_others(llm, prompt, 24, seed=5)[0] == alone
        warm, out = run_with_others(llm, prompt, 3, seed=6)
        assert out.num_cached_tokens >= 128 and warm == alone


@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_teacher_forced_within_the_measured_error(llama, prompts, hf_oracle, fmt):
    """The Triton kernels (interpreted) on a quantized pool: short prompts in 16-token chunks, prompt
    logprobs within the format's bound of HF's and next to the compiled CPU kernels' on the same
    pool format."""
    chosen = [prompts[0], prompts[1][:30], prompts[3][:40]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    outs = {}
    for backend in ("triton", "cpu"):
        with LLM(model=llama, kv_cache_dtype=fmt, attention_backend=backend, block_size=16, max_model_len=64,
                 max_num_batched_tokens=16, enable_prefix_caching=False) as llm:
            assert llm.stats()["attention_backend"] == backend
            outs[backend] = llm.generate([{"prompt_token_ids": p} for p in chosen], params)
    for prompt, out, cpu in zip(chosen, outs["triton"], outs["cpu"]):
        ref = hf_oracle(ARCH).log_softmax(prompt)
        worst = max(abs(out.prompt_logprobs[pos][prompt[pos]][0] - float(ref[pos - 1, prompt[pos]]))
                    for pos in range(1, len(prompt)))
        assert worst <= TOL[fmt]
        # the same stored bytes, float32 sums in another order (the interpreter's tl.dot is numpy's):
        # measured up to 1.5e-4 apart
        for pos in range(1, len(prompt)):
            assert out.prompt_logprobs[pos][prompt[pos]][0] == pytest.approx(
                cpu.prompt_logprobs[pos][prompt[pos]][0], abs=5e-4)
