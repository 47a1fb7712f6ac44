"""Greedy generation equals Hugging Face transformers by teacher forcing, for every architecture,
under every setting that changes how the KV cache is laid out or when tokens are computed."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.block_hash import hash_blocks
from tests.conftest import ARCHS
from tests.e2e.prompts import test_prompts as make_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def generate_and_check(llm, oracle, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt
        for sample in out.outputs:
            assert len(sample.token_ids) == params.max_tokens and sample.finish_reason == "length"
            oracle.assert_greedy(prompt, sample.token_ids)
    return outs


def expected_hits(prompts, block_size, cached: set | None = None) -> int:
    """Prompt tokens the prefix cache serves when ``prompts`` are first scheduled in this order in
    one step (blocks enter the cache when planned: a later prompt of the same step hits an earlier
    one's), each hit a chain of full blocks stopping one token short of its prompt. ``cached``
    (updated) holds the hashes already cached."""
    cached = set() if cached is None else cached
    hits = 0
    for prompt in prompts:
        hashes = hash_blocks(prompt, block_size)
        for h in hashes[:(len(prompt) - 1) // block_size]:
            if h not in cached:
                break
            hits += block_size
        cached.update(hashes)
    return hits


BACKENDS = {  # attention backends, and the compiled one without shared-prefix groups
    "torch": {"attention_backend": "torch"},
    "cpu": {"attention_backend": "cpu"},
    "cpu-nocascade": {"attention_backend": "cpu", "cascade_attention": False},
}


def cascade_steps(llm) -> int:
    return llm.core.executor.worker.runner.batch.num_cascade_steps


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("caching", [True, False], ids=["cache", "nocache"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_greedy_matches_hf(arch, caching, backend, model_dirs, hf_oracle):
    prompts = make_prompts(model_dirs[arch])
    with LLM(model=model_dirs[arch], enable_prefix_caching=caching, **BACKENDS[backend]) as llm:
        assert llm.stats()["attention_backend"] == BACKENDS[backend]["attention_backend"]
        first = generate_and_check(llm, hf_oracle(arch), prompts)
        # the shared 300-token prefix is attended once per step for every request that holds it
        assert (cascade_steps(llm) > 0) == (backend == "cpu" and caching)
        stats = llm.stats()
        assert stats["num_blocks_in_use"] == 0
        if caching:
            cached: set = set()
            assert stats["prefix_cache_hits"] == expected_hits(prompts, 16, cached) == 288  # the shared prefix
            assert stats["prefix_cache_queries"] == sum(len(p) for p in prompts)
            # a warm rerun: the same tokens, now from the cache up to each prompt's last full block
            again = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
            assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
            warm = expected_hits(prompts, 16, cached)
            assert warm == sum((len(p) - 1) // 16 * 16 for p in prompts)
            assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // 16 * 16 for p in prompts]
            stats = llm.stats()
            assert stats["prefix_cache_hits"] == 288 + warm
            assert stats["prefix_cache_hit_rate"] == (288 + warm) / (2 * sum(len(p) for p in prompts))
        else:
            assert stats["prefix_cache_queries"] == stats["prefix_cache_hits"] == 0


@pytest.mark.parametrize("block_size", [8, 32])
def test_block_sizes(block_size, model_dirs, hf_oracle):
    prompts = make_prompts(model_dirs["llama"])
    with LLM(model=model_dirs["llama"], block_size=block_size) as llm:
        generate_and_check(llm, hf_oracle("llama"), prompts)
        # the 300-token shared prefix, in whole blocks
        assert llm.stats()["prefix_cache_hits"] == expected_hits(prompts, block_size) == 300 // block_size * block_size


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_preemption_and_chunked_prefill(arch, backend, model_dirs, hf_oracle):
    """A pool that holds ~1.3 long sequences and a 64-token budget: prompts are chunked, the newest
    request is preempted and recomputed, and the tokens do not change."""
    prompts = make_prompts(model_dirs[arch])
    with LLM(model=model_dirs[arch], block_size=16, num_kv_blocks=48, max_model_len=520,
             max_num_batched_tokens=64, max_num_seqs=8, **BACKENDS[backend]) as llm:
        generate_and_check(llm, hf_oracle(arch), prompts)
        stats = llm.stats()
        assert stats["num_preemptions"] > 0
        assert stats["num_blocks_in_use"] == 0


def test_n_samples_share_the_prompt(model_dirs, hf_oracle):
    prompts = make_prompts(model_dirs["llama"])[3:5]
    params = SamplingParams(n=3, temperature=0.0, max_tokens=12, ignore_eos=True)
    for caching in (True, False):
        with LLM(model=model_dirs["llama"], enable_prefix_caching=caching) as llm:
            outs = generate_and_check(llm, hf_oracle("llama"), prompts, params)
            for out in outs:
                assert [s.index for s in out.outputs] == [0, 1, 2]
                assert len({tuple(s.token_ids) for s in out.outputs}) == 1
            stats = llm.stats()
            assert stats["num_blocks_in_use"] == 0
            # only the first sample of each prompt is a prefix-cache query
            expected = sum(len(p) for p in prompts) if caching else 0
            assert stats["prefix_cache_queries"] == expected
            # the two prompts share 300 tokens: the second hits them, its samples fork instead
            assert stats["prefix_cache_hits"] == (expected_hits(prompts, 16) if caching else 0)
            assert [o.num_cached_tokens for o in outs] == ([0, 288] if caching else [0, 0])


def test_logprobs_match_hf_log_softmax(model_dirs, hf_oracle):
    prompt = make_prompts(model_dirs["qwen2"])[2]
    with LLM(model=model_dirs["qwen2"]) as llm:
        out = llm.generate({"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, ignore_eos=True))[0]
    sample = out.outputs[0]
    assert len(sample.logprobs) == 6
    reference = hf_oracle("qwen2").log_softmax(prompt + sample.token_ids)
    for i, (token, lp) in enumerate(zip(sample.token_ids, sample.logprobs)):
        row = reference[len(prompt) - 1 + i]
        assert token in lp and len(lp) in (5, 6)
        for token_id, value in lp.items():
            assert abs(value - float(row[token_id])) < 1e-4
        top5 = sorted((v for t, v in lp.items()), reverse=True)[:5]
        assert top5 == pytest.approx(row.topk(5).values.tolist(), abs=1e-4)
