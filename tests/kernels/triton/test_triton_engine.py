"""The whole engine on the Triton path (attention, KV store, norms, SiLU-and-multiply and rotary as
Triton kernels, here under the interpreter) against Hugging Face by teacher forcing: chunked
prefill, a prefix-cache hit and decodes over a block size that does not divide the prompts."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.e2e.prompts import test_prompts as make_prompts


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_matches_hf_on_the_triton_path(arch, model_dirs, hf_oracle):
    prompts = make_prompts(model_dirs[arch])
    shared = prompts[3][:23]  # two prompts sharing 23 tokens: four full blocks of 5 hit the cache
    chosen = [prompts[1], shared + prompts[2][:9], shared + prompts[0] + prompts[1][:4]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(model=model_dirs[arch], attention_backend="triton", block_size=5, num_kv_blocks=48, max_model_len=96,
             max_num_batched_tokens=16, enable_prefix_caching=True) as llm:
        runner = llm.core.executor.worker.runner
        assert runner.attention_backend.name == "triton"
        assert runner.model.model.norm.ops is runner.attention_backend.fused_ops  # the Triton layer ops run
        first = llm.generate([{"prompt_token_ids": p} for p in chosen[:2]], params)
        second = llm.generate([{"prompt_token_ids": chosen[2]}], params)
        stats = llm.stats()
    for prompt, out in zip(chosen, first + second):
        assert len(out.outputs[0].token_ids) == 6
        hf_oracle(arch).assert_greedy(prompt, out.outputs[0].token_ids)
    assert second[0].num_cached_tokens == 20  # the shared 23 tokens: four full blocks of 5
    assert stats["attention_backend"] == "triton"
