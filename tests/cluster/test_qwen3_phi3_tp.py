"""Qwen3 and Phi-3 at tensor-parallel size 2 over Ray worker actors: each rank loads its heads (Phi-3's
fused qkv / gate_up cut per rank), with chunked prefill, preemption and prefix caching in play: the
same greedy tokens as at tp 1, each judged by Hugging Face transformers (teacher forcing), Phi-3's
prompts below and above its LongRoPE original length alike; the same scheduling as at tp 1."""

from __future__ import annotations

import pytest

from engine import LLM
from tests.e2e.prompts import test_prompts as make_prompts
from tests.e2e.families import FAMILIES, STRESS, check, generate


@pytest.mark.parametrize("arch", FAMILIES)
def test_tp2_matches_hf_and_tp1(arch, ray_cluster, family_dirs, family_oracle, stress_runs):
    prompts, tp1 = make_prompts(family_dirs[arch]), stress_runs(arch, "cpu")
    with LLM(model=family_dirs[arch], tensor_parallel_size=2, **STRESS) as llm:
        tokens, stats = generate(llm, prompts), llm.stats()
    assert stats["attention_backend"] == tp1["stats"]["attention_backend"] == "cpu"  # compiled kernels per rank
    assert tokens == tp1["tokens"]
    check(family_oracle(arch), prompts, tokens)
    assert stats["kv_heads_per_rank"] == 1
    assert stats["kv_pool_bytes_by_rank"] == [tp1["stats"]["kv_pool_bytes_per_rank"] // 2] * 2
    assert stats["num_preemptions"] > 0 and stats["num_preemptions"] == tp1["stats"]["num_preemptions"]
    assert stats["prefix_cache_hits"] == tp1["stats"]["prefix_cache_hits"] >= 288
    assert stats["num_blocks_in_use"] == 0
