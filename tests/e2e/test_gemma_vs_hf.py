"""Gemma 2 and Gemma 3 (text) against Hugging Face transformers by teacher forcing, with prompts longer
than the sliding window (48 and 40 tokens in the tiny presets: the 500-, 341-, 320- and 129-token
prompts), on the compiled CPU kernels (prefix cache, shared-prefix groups, a warm rerun served from
the cache) and on plain torch (chunked prefill and preemption in a small pool). The Triton path:
``tests/kernels/triton/test_triton_gemma.py``; tensor parallelism: ``tests/cluster/test_gemma_tp.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.e2e.prompts import test_prompts as make_prompts
from tests.gemma_models import GEMMA_ARCHS, gemma_dir, gemma_oracle

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def generate(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
    return outs


def check(arch, prompts, outs):
    for prompt, out in zip(prompts, outs):
        gemma_oracle(arch).assert_greedy(prompt, out.outputs[0].token_ids)


def test_the_window_and_the_caps_matter_in_these_checkpoints():
    """HF's logits over the 500-token prompt change when the sliding layers see everything, or when
    the soft-caps are lifted: a model that ignored either would fail the comparisons below."""
    for arch in GEMMA_ARCHS:
        model = gemma_oracle(arch).model
        prompt = torch.tensor([make_prompts(gemma_dir(arch))[5]])
        attention = [layer.self_attn for layer in model.model.layers]
        config, caps = model.config, [a.attn_logit_softcapping for a in attention]
        saved = config.sliding_window, config.final_logit_softcapping
        changes = [("sliding_window", 4096), ("final_logit_softcapping", None)]
        changes += [("attn_logit_softcapping", None)] if arch == "gemma2" else []
        with torch.no_grad():
            logits = model(prompt).logits[0]
            try:
                for name, value in changes:  # read at each forward (the mask, the head) or per layer
                    for target in [config] if name != "attn_logit_softcapping" else attention:
                        setattr(target, name, value)
                    assert (model(prompt).logits[0] - logits).abs().max() > 0.05, (arch, name)
                    config.sliding_window, config.final_logit_softcapping = saved
                    for a, cap in zip(attention, caps):
                        a.attn_logit_softcapping = cap
            finally:
                config.sliding_window, config.final_logit_softcapping = saved
                for a, cap in zip(attention, caps):
                    a.attn_logit_softcapping = cap
            assert torch.equal(model(prompt).logits[0], logits)


@pytest.mark.parametrize("arch", GEMMA_ARCHS)
def test_compiled_kernels_with_prefix_cache_and_shared_prefix_groups(arch):
    path = gemma_dir(arch)
    config = json.loads((Path(path) / "config.json").read_text())
    prompts = make_prompts(path)
    assert sum(len(p) > config["sliding_window"] for p in prompts) == 4
    with LLM(model=path, attention_backend="cpu") as llm:
        runner = llm.core.executor.worker.runner
        # the kernels implement the window: contexts are not capped to it
        assert llm.core.config.max_model_len == config["max_position_embeddings"]
        windows = [layer.self_attn.attn.window for layer in runner.model.model.layers]
        assert windows == [config["sliding_window"] if t == "sliding_attention" else 0 for t in config["layer_types"]]
        first = generate(llm, prompts)
        assert runner.batch.num_cascade_steps > 0  # the shared 300 tokens attended once per step
        assert llm.stats()["prefix_cache_hits"] == 288
        again = generate(llm, prompts)  # warm: each prompt from the cache up to its last full block
        assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // 16 * 16 for p in prompts]
        assert llm.stats()["num_blocks_in_use"] == 0
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    check(arch, prompts, first)


TIGHT_PAGES = {"gemma2": 48, "gemma3": 80}


@pytest.mark.parametrize("arch", GEMMA_ARCHS)
def test_torch_backend_with_chunked_prefill_and_preemption(arch):
    """A pool of ~1.5 long sequences and a 64-token budget: prompts are chunked across the window's
    edge, the newest request is preempted and recomputed, prefix hits land mid-window. (Pages of the
    hybrid layout: Gemma 3 tiny's page holds its one full layer, and a 520-token sequence with its
    window pages needs up to 74 of them; Gemma 2 tiny's holds two layers.)"""
    path = gemma_dir(arch)
    prompts = make_prompts(path)
    with LLM(model=path, attention_backend="torch", block_size=16, num_kv_blocks=TIGHT_PAGES[arch], max_model_len=520,
             max_num_batched_tokens=64, max_num_seqs=8) as llm:
        outs = generate(llm, prompts)
        stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0 and stats["num_blocks_in_use"] == 0
    check(arch, prompts, outs)
