"""Tensor parallelism over Ray worker actors: outputs equal to Hugging Face (and to TP=1) for every
architecture, KV heads replicated at TP=4, preemption and chunked prefill at TP=2, the per-rank KV
memory, placement errors, and the scheduler actor."""

from __future__ import annotations

import asyncio

import pytest

from cluster.placement import PlacementError
from engine import LLM, SamplingParams, engine_config
from tests.conftest import ARCHS
from tests.e2e.prompts import test_prompts as make_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def generate(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.fixture(scope="module")
def tp1_tokens(tp1_runs):
    """Greedy tokens at TP=1, per arch, for the standard prompts."""
    return {arch: tokens for arch, (tokens, _) in tp1_runs.items()}


@pytest.fixture(scope="module")
def tp1_runs(model_dirs):
    """(greedy tokens, engine stats) at TP=1, per arch, for the standard prompts."""
    result = {}
    for arch in ARCHS:
        with LLM(model=model_dirs[arch]) as llm:
            result[arch] = generate(llm, make_prompts(model_dirs[arch])), llm.stats()
    return result


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_matches_hf_and_tp1(arch, ray_cluster, model_dirs, hf_oracle, tp1_runs):
    prompts = make_prompts(model_dirs[arch])
    with LLM(model=model_dirs[arch], tensor_parallel_size=2) as llm:
        tokens = generate(llm, prompts)
        stats = llm.stats()
    tp1_tokens, tp1 = tp1_runs[arch]
    assert tokens == tp1_tokens
    for prompt, out in zip(prompts, tokens):
        hf_oracle(arch).assert_greedy(prompt, out)
    assert stats["num_blocks_in_use"] == 0 and stats["prefix_cache_hits"] > 0
    # the scheduler is the same at any TP: the same prefix-cache queries and hits as at TP=1
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (tp1["prefix_cache_queries"],
                                                                        tp1["prefix_cache_hits"])


def test_tp4_replicates_kv_heads(ray_cluster, model_dirs, hf_oracle, tp1_tokens):
    """llama tiny has 4 heads and 2 KV heads: at TP=4 each rank holds one query head and a copy of
    one KV head, so a rank's pool is half (not a quarter) of the TP=1 pool."""
    prompts = make_prompts(model_dirs["llama"])
    with LLM(model=model_dirs["llama"], num_kv_blocks=256) as llm1:
        tp1 = llm1.stats()
    with LLM(model=model_dirs["llama"], tensor_parallel_size=4, num_kv_blocks=256) as llm:
        tokens = generate(llm, prompts)
        stats = llm.stats()
    assert tokens == tp1_tokens["llama"]
    for prompt, out in zip(prompts, tokens):
        hf_oracle("llama").assert_greedy(prompt, out)
    assert stats["kv_heads_replicated"] is True and stats["kv_heads_per_rank"] == 1
    assert stats["kv_pool_bytes_by_rank"] == [tp1["kv_pool_bytes_per_rank"] // 2] * 4


def test_tp2_pool_is_half_per_rank_and_stress(ray_cluster, model_dirs, hf_oracle):
    """Small pool and budget at TP=2: preemption and chunked prefill, tokens unchanged; each rank
    holds exactly half of the TP=1 pool."""
    prompts = make_prompts(model_dirs["qwen2"])
    kwargs = dict(block_size=16, num_kv_blocks=48, max_model_len=520, max_num_batched_tokens=64)
    with LLM(model=model_dirs["qwen2"], **kwargs) as llm1:
        tp1_tokens, tp1 = generate(llm1, prompts), llm1.stats()
    with LLM(model=model_dirs["qwen2"], tensor_parallel_size=2, **kwargs) as llm:
        tokens, stats = generate(llm, prompts), llm.stats()
    assert tokens == tp1_tokens
    for prompt, out in zip(prompts, tokens):
        hf_oracle("qwen2").assert_greedy(prompt, out)
    assert stats["num_preemptions"] > 0 and stats["num_preemptions"] == tp1["num_preemptions"]
    assert stats["prefix_cache_hit_rate"] == tp1["prefix_cache_hit_rate"]
    assert stats["kv_pool_bytes_by_rank"] == [tp1["kv_pool_bytes_per_rank"] // 2] * 2
    assert stats["num_blocks_in_use"] == 0


def test_placement_that_cannot_fit_fails_fast(ray_cluster, model_dirs):
    with pytest.raises(PlacementError, match="STRICT_PACK"):
        LLM(model=model_dirs["llama"], tensor_parallel_size=16)


def test_scheduler_actor_streams_and_aborts(ray_cluster, model_dirs):
    import ray

    from cluster.scheduler_actor import launch_scheduler_actor

    actor = launch_scheduler_actor(engine_config(model_dirs["opt"], tensor_parallel_size=2))
    prompt = make_prompts(model_dirs["opt"])[2]

    async def stream(request_id, max_tokens, stop_after=None):
        tokens = []
        gen = actor.generate.remote(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                        ignore_eos=True))
        async for ref in gen:
            out = await ref
            tokens += out.outputs[0].token_ids if out.outputs else []
            if stop_after is not None and len(tokens) >= stop_after:
                ray.cancel(gen)
                break
        return tokens

    async def main():
        full, partial = await asyncio.gather(stream("a", 12), stream("b", 200, stop_after=3))
        return full, partial

    full, partial = asyncio.run(main())
    with LLM(model=model_dirs["opt"]) as llm:
        assert full == generate(llm, [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert partial == full[: len(partial)]
    with pytest.raises(ValueError, match="max_model_len"):
        ray.get(actor.generate_full.remote("bad", [5] * 5000))
    for _ in range(100):  # the cancelled request is aborted and its blocks freed
        stats = ray.get(actor.stats.remote())
        if stats["num_requests_running"] == 0:
            break
    assert stats["num_blocks_in_use"] == 0 and stats["num_requests_running"] == 0
    ray.get(actor.shutdown.remote())
    ray.kill(actor)


@pytest.mark.parametrize("fmt", ("int8", "fp8_e4m3"))
def test_tp2_with_a_quantized_pool(fmt, ray_cluster, model_dirs, hf_oracle):
    """A quantized pool at TP=2: each rank quantizes the rows of its own KV head (a row's scale is its
    own, so the split changes no byte), the same greedy tokens as TP=1 in the format, prompt logprobs
    within the format's measured error of HF's (tests/e2e/test_kv_quant.py), each rank half the
    TP=1 pool's bytes, in uint8 rows of head_dim codes + a 2-byte scale."""
    from tests.e2e.test_kv_quant import TOL

    prompts = make_prompts(model_dirs["llama"])[1:6]
    kwargs = dict(kv_cache_dtype=fmt, block_size=16, num_kv_blocks=128, max_model_len=1024, max_num_batched_tokens=64)
    with LLM(model=model_dirs["llama"], **kwargs) as llm1:
        tp1_tokens, tp1 = generate(llm1, prompts), llm1.stats()
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    with LLM(model=model_dirs["llama"], tensor_parallel_size=2, **kwargs) as llm:
        tokens = generate(llm, prompts)
        scored = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        stats = llm.stats()
    assert tokens == tp1_tokens
    worst = max(abs(out.prompt_logprobs[pos][prompt[pos]][0] - float(hf_oracle("llama").log_softmax(prompt)[pos - 1, prompt[pos]]))
                for prompt, out in zip(prompts, scored) for pos in range(1, len(prompt)))
    assert TOL["auto"] < worst <= TOL[fmt]  # quantized, within the format's error
    assert stats["kv_cache_dtype"] == tp1["kv_cache_dtype"] == fmt
    head_dim = 16  # llama tiny: 2 KV heads of 16, one per rank
    assert stats["kv_bytes_per_block_per_rank"] == 16 * 1 * (head_dim + 2) * 2 * 2  # tokens x heads x row x K,V x layers
    assert stats["kv_pool_bytes_by_rank"] == [tp1["kv_pool_bytes_per_rank"] // 2] * 2
    assert stats["num_blocks_in_use"] == 0
