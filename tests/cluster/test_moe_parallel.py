"""Mixture-of-experts models over two Ray ranks: every expert's intermediate features split (tensor
parallelism) and whole experts per rank (``enable_expert_parallel``), each giving the tokens of TP=1
and of Hugging Face, with chunked prefill and prefix caching in play; each rank holds only its slice
or its experts."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.e2e.test_moe_vs_hf import MOE_ARCHS, moe_dirs, moe_oracle, stress_prompts  # noqa: F401 (fixtures)

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# chunked prefill (a 64-token budget) and the prefix cache (two prompts share 300 tokens)
SETTINGS = dict(block_size=16, max_num_batched_tokens=64, max_num_seqs=8)


def prompts_for(model_dir: str) -> list[list[int]]:
    """The two prompts that share 300 tokens (320 and 341): chunked, the second hitting the first's blocks."""
    return stress_prompts(model_dir)[1:3]


def generate(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


def rank_experts(llm) -> list[tuple]:
    """Per rank, the first MoE layer's (first expert, experts held, first intermediate feature,
    intermediate features held), asked of the rank actors themselves."""
    import ray

    def probe(actor):
        moe = next(m for m in actor.worker.runner.model.modules() if type(m).__name__ == "FusedMoE")
        return moe.expert_start, moe.num_local_experts, moe.inter_start, moe.intermediate

    return ray.get([actor.__ray_call__.remote(probe) for actor in llm.core.executor.group.actors])


@pytest.fixture(scope="module")
def tp1_runs(moe_dirs):  # noqa: F811
    out = {}
    for arch in MOE_ARCHS:
        with LLM(model=moe_dirs[arch], **SETTINGS) as llm:
            out[arch] = generate(llm, prompts_for(moe_dirs[arch])), llm.stats()
    return out


# both families whole-expert; the intermediate split on Mixtral (Qwen3-MoE's experts split the same way)
@pytest.mark.parametrize("arch,expert_parallel", [("mixtral", False), ("mixtral", True), ("qwen3_moe", True)],
                         ids=["mixtral-tp2", "mixtral-ep2", "qwen3_moe-ep2"])
def test_two_ranks_match_tp1_and_hf(arch, expert_parallel, ray_cluster, moe_dirs, moe_oracle, tp1_runs):  # noqa: F811
    prompts = prompts_for(moe_dirs[arch])
    with LLM(model=moe_dirs[arch], tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
             **SETTINGS) as llm:
        tokens, stats = generate(llm, prompts), llm.stats()
        held = rank_experts(llm)
    tp1_tokens, tp1 = tp1_runs[arch]
    assert tokens == tp1_tokens
    for prompt, out in zip(prompts, tokens):
        moe_oracle(arch).assert_greedy(prompt, out)
    assert stats["prefix_cache_hits"] == tp1["prefix_cache_hits"] >= 288 and stats["num_blocks_in_use"] == 0
    # what each rank loaded (the tiny presets: 8 experts of 48 intermediate features): half of the
    # experts whole, or every expert's half
    assert held == ([(0, 4, 0, 48), (4, 4, 0, 48)] if expert_parallel else [(0, 8, 0, 24), (0, 8, 24, 24)])
