"""The Triton kernels (under the interpreter) at tensor-parallel size 2 over Ray worker actors, on the
newer families: Gemma 3 (window layers on the hybrid KV layout, query/key norms; the tiny preset's two
KV heads of 64, one per rank) and Qwen3-MoE with whole experts per rank (``enable_expert_parallel``). Each
gives the tokens of Hugging Face by teacher forcing, with chunked prefill across the window's edge, a
prefix-cache hit and decodes, and each rank ran its attention, layer ops and fused MoE as Triton's."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.e2e.prompts import test_prompts as make_prompts
from tests.e2e.test_moe_vs_hf import moe_dirs, moe_oracle  # noqa: F401 (fixtures)
from tests.gemma_models import gemma_dir, gemma_oracle

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
SETTINGS = dict(attention_backend="triton", tensor_parallel_size=2, block_size=5, max_model_len=96,
                max_num_batched_tokens=16, enable_prefix_caching=True)


def rank_backends(llm) -> list[tuple[str, int, bool]]:
    """Per rank: its attention backend's name, its KV heads, and whether every fused-MoE layer it holds
    (if any) runs the Triton fused MoE."""
    import ray

    def probe(actor):
        from kernels.triton import TritonAttentionBackend

        runner = actor.worker.runner
        moe = [m for m in runner.model.modules() if type(m).__name__ == "FusedMoE"]
        return (runner.attention_backend.name, runner.kv_spec.num_kv_heads,
                all(m.ops is TritonAttentionBackend.fused_ops for m in moe))

    return ray.get([actor.__ray_call__.remote(probe) for actor in llm.core.executor.group.actors])


def run(path: str, prompts: list[list[int]], **extra) -> tuple[list, dict, list]:
    """The first two prompts together, then the third (sharing the second's first blocks)."""
    with LLM(model=path, **SETTINGS, **extra) as llm:
        first = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], GREEDY)
        second = llm.generate([{"prompt_token_ids": prompts[2]}], GREEDY)
        stats, ranks = llm.stats(), rank_backends(llm)
    return first + second, stats, ranks


def test_gemma3_on_triton_at_tp2_matches_hf(ray_cluster):
    path = gemma_dir("gemma3")
    prompts = make_prompts(path)
    shared = prompts[3][:53]  # ten full blocks of 5 hit the cache; the window (40) lies inside them
    chosen = [prompts[5][:50], shared + prompts[1], shared + prompts[6][:5]]
    outs, stats, ranks = run(path, chosen, num_kv_blocks=110)
    assert stats["attention_backend"] == "triton" and stats["kv_window_groups"] > 0
    assert [r[:2] for r in ranks] == [("triton", 1), ("triton", 1)]
    assert outs[2].num_cached_tokens == 50
    assert stats["num_blocks_in_use"] == 0
    for prompt, out in zip(chosen, outs):
        assert len(out.outputs[0].token_ids) == 3
        gemma_oracle("gemma3").assert_greedy(prompt, out.outputs[0].token_ids)


def test_qwen3_moe_expert_parallel_on_triton_at_tp2_matches_hf(ray_cluster, moe_dirs, moe_oracle):  # noqa: F811
    prompts = make_prompts(moe_dirs["qwen3_moe"])
    shared = prompts[3][:23]
    chosen = [prompts[1], shared + prompts[2][:9], shared + prompts[0] + prompts[1][:4]]
    outs, stats, ranks = run(moe_dirs["qwen3_moe"], chosen, num_kv_blocks=48, enable_expert_parallel=True)
    assert all(name == "triton" and fused for name, _, fused in ranks)
    assert outs[2].num_cached_tokens == 20
    for prompt, out in zip(chosen, outs):
        moe_oracle("qwen3_moe").assert_greedy(prompt, out.outputs[0].token_ids)
