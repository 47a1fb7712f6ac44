"""Gemma 2 (head size 256, soft-capped scores) and Gemma 3 (five local layers per global one) on the
Triton path, under the interpreter, against Hugging Face by teacher forcing: prompts longer than the
window (48 / 40 tokens), chunked prefill across its edge, a prefix-cache hit and decodes over a block
size that divides neither."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.e2e.prompts import test_prompts as make_prompts
from tests.gemma_models import GEMMA_ARCHS, gemma_dir, gemma_oracle


@pytest.mark.parametrize("arch", GEMMA_ARCHS)
def test_greedy_matches_hf_on_the_triton_path(arch):
    path = gemma_dir(arch)
    prompts = make_prompts(path)
    shared = prompts[3][:53]  # two prompts sharing 53 tokens: ten full blocks of 5 hit the cache
    chosen = [prompts[5][:50], shared + prompts[1], shared + prompts[6][:5]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(model=path, attention_backend="triton", block_size=5, num_kv_blocks=64 if arch == "gemma2" else 110, max_model_len=128,
             max_num_batched_tokens=32, enable_prefix_caching=True) as llm:
        assert llm.stats()["attention_backend"] == "triton"
        first = llm.generate([{"prompt_token_ids": p} for p in chosen[:2]], params)
        second = llm.generate([{"prompt_token_ids": chosen[2]}], params)
    assert second[0].num_cached_tokens == 50
    for prompt, out in zip(chosen, first + second):
        assert len(out.outputs[0].token_ids) == 4
        gemma_oracle(arch).assert_greedy(prompt, out.outputs[0].token_ids)
