"""Gemma 2 and Gemma 3 (text) at tensor-parallel size 2 over Ray worker actors: the same tokens as at
TP 1 and as Hugging Face (teacher forcing), with prompts longer than the window, chunked prefill,
preemption and prefix-cache hits in a small pool, and shared-prefix groups in a large one."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.e2e.prompts import test_prompts as make_prompts
from tests.gemma_models import GEMMA_ARCHS, gemma_dir, gemma_oracle

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
TIGHT = dict(block_size=16, max_model_len=520, max_num_batched_tokens=64, max_num_seqs=8)
# pages of the hybrid KV layout: Gemma 3 tiny's holds one layer (a 520-token sequence needs up to 74 with
# its window pages), Gemma 2 tiny's two
TIGHT_PAGES = {"gemma2": 48, "gemma3": 80}


@pytest.fixture(scope="module")
def built():
    """The checkpoints and oracles, made before the module's Ray cluster starts (a build's tokenizer
    training beside a starting cluster on a loaded machine can starve its node's heartbeats)."""
    for arch in GEMMA_ARCHS:
        gemma_oracle(arch)


def generate(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


@pytest.mark.parametrize("arch", GEMMA_ARCHS)
def test_tp2_matches_hf_and_tp1(arch, built, ray_cluster):
    path = gemma_dir(arch)
    prompts = make_prompts(path)
    with LLM(model=path, num_kv_blocks=TIGHT_PAGES[arch], **TIGHT) as llm1:
        tp1 = generate(llm1, prompts)
    with LLM(model=path, tensor_parallel_size=2, num_kv_blocks=TIGHT_PAGES[arch], **TIGHT) as llm:
        tight = generate(llm, prompts)
        stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0 and stats["num_blocks_in_use"] == 0
    assert stats["kv_heads_per_rank"] == 1
    with LLM(model=path, tensor_parallel_size=2) as llm:  # room for all: the shared 300 tokens grouped
        roomy = generate(llm, prompts)
        assert llm.stats()["prefix_cache_hits"] == 288
    assert tight == tp1 and roomy == tp1
    for prompt, out in zip(prompts, tight):
        gemma_oracle(arch).assert_greedy(prompt, out)


def test_gemma3_hybrid_layout_with_an_int8_pool_at_tp2(built, ray_cluster):
    """Gemma 3's hybrid KV layout (window pages beside the block table) over an int8 pool at TP 2, in a
    pool small enough to preempt: the tokens of TP 1 in the same format, the window groups in use,
    and every block and window page back at the end."""
    path = gemma_dir("gemma3")
    prompts = make_prompts(path)
    kwargs = dict(num_kv_blocks=TIGHT_PAGES["gemma3"], kv_cache_dtype="int8", **TIGHT)
    with LLM(model=path, **kwargs) as llm1:
        tp1 = generate(llm1, prompts)
    with LLM(model=path, tensor_parallel_size=2, **kwargs) as llm:
        tokens = generate(llm, prompts)
        stats = llm.stats()
    assert tokens == tp1
    assert stats["kv_cache_dtype"] == "int8" and stats["kv_window_groups"] > 0
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["num_blocks_in_use"] == 0 and stats["kv_window_pages_held"] == 0
