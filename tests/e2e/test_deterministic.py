"""Deterministic serving: with ``deterministic=True`` a greedy request's tokens and logprobs are the
same to the bit whatever shares its batch, whatever the chunk budget, with or without a prefix-cache
hit, and after a preemption. Logprob floats are compared with ==."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams

TARGET = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(100, 3000) for _ in range(length)]


def target_prompt() -> list[int]:
    return random_prompt(random.Random(7), 150)


def fingerprint(output, target: SamplingParams = TARGET) -> tuple:
    """The target's tokens and every logprob it reported, as exact floats."""
    sample = output.outputs[0]
    assert len(sample.token_ids) == target.max_tokens
    return tuple(sample.token_ids), tuple(tuple(sorted((t, lp.logprob if hasattr(lp, "logprob") else lp)
                                                        for t, lp in step.items())) for step in sample.logprobs)


def run_with_others(llm: LLM, prompt: list[int], num_others: int, seed: int, target: SamplingParams = TARGET,
                    max_other_len: int = 300, max_other_tokens: int = 40):
    """The target among ``num_others`` random requests (random lengths, some sampled, finishing at
    different steps), at a random place in the submission order -> (fingerprint, target output)."""
    rng = random.Random(seed)
    prompts = [random_prompt(rng, rng.randint(1, max_other_len)) for _ in range(num_others)]
    params = [SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randint(1, max_other_tokens),
                             ignore_eos=True, seed=rng.randrange(1000)) for _ in range(num_others)]
    place = rng.randint(0, num_others)
    prompts.insert(place, prompt)
    params.insert(place, target)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return fingerprint(outs[place], target), outs[place]


def engine(model_dir: str, deterministic: bool = True, **kwargs) -> LLM:
    return LLM(model=model_dir, attention_backend="cpu", deterministic=deterministic, **kwargs)


@pytest.fixture(scope="module")
def reference(model_dirs):
    """The target alone, cold cache, the default budget."""
    with engine(model_dirs["llama"], enable_prefix_caching=False) as llm:
        return run_with_others(llm, target_prompt(), 0, 0)[0]


@pytest.mark.parametrize("budget", [16, 2048])
def test_same_bits_in_any_batch_budget_and_cache_state(budget, reference, model_dirs):
    prompt = target_prompt()
    with engine(model_dirs["llama"], max_num_batched_tokens=budget) as llm:
        first, out = run_with_others(llm, prompt, 5, seed=budget)  # cold cache
        assert out.num_cached_tokens == 0
        assert first == reference
        for num_others, seed in ((1, 1), (64, 2)):
            again, out = run_with_others(llm, prompt, num_others, seed)  # warm: the prompt's blocks are cached
            assert out.num_cached_tokens >= 128
            assert again == reference, f"{num_others} others, budget {budget}, warm cache"
        llm.reset_prefix_cache()
        cold, out = run_with_others(llm, prompt, 64, seed=3)
        assert out.num_cached_tokens == 0 and cold == reference


def test_same_bits_after_preemption(reference, model_dirs):
    """A pool of 40 blocks of 16 tokens for 24 requests: the newest running requests are preempted
    and recomputed (decode-computed tokens computed again inside prefill chunks)."""
    with engine(model_dirs["llama"], block_size=16, num_kv_blocks=40, max_model_len=400, max_num_batched_tokens=64,
                max_num_seqs=16) as llm:
        result, _ = run_with_others(llm, target_prompt(), 23, seed=4)
        assert llm.stats()["num_preemptions"] > 0
        assert result == reference
        assert llm.stats()["num_blocks_in_use"] == 0


@pytest.mark.parametrize("arch", ["qwen2", "opt"])
def test_other_architectures(arch, model_dirs):
    """qwen2 (biased qkv, the compiled stack) and opt (the layer-by-layer path, LayerNorm, ReLU)."""
    prompt = target_prompt()
    with engine(model_dirs[arch], max_num_batched_tokens=2048, enable_prefix_caching=False) as llm:
        alone, _ = run_with_others(llm, prompt, 0, 0)
    with engine(model_dirs[arch], max_num_batched_tokens=32) as llm:
        assert run_with_others(llm, prompt, 24, seed=5)[0] == alone
        assert run_with_others(llm, prompt, 3, seed=6)[0] == alone  # warm


def test_default_mode_is_not_batch_invariant(model_dirs):
    """Without the setting, the same comparisons do differ: the mode is doing something."""
    prompt = target_prompt()
    with engine(model_dirs["llama"], deterministic=False, enable_prefix_caching=False) as llm:
        alone, _ = run_with_others(llm, prompt, 0, 0)
    with engine(model_dirs["llama"], deterministic=False, max_num_batched_tokens=16) as llm:
        results = [run_with_others(llm, prompt, n, seed)[0] for n, seed in ((5, 16), (64, 2))]
    assert any(r != alone for r in results)


def test_refused_with_the_torch_backend(model_dirs):
    with pytest.raises(ValueError, match="deterministic=True needs attention_backend 'cpu', 'triton' or 'auto', not 'torch'"):
        LLM(model=model_dirs["llama"], attention_backend="torch", deterministic=True)


def test_refused_above_two_ranks(model_dirs):
    with pytest.raises(ValueError, match="deterministic=True runs at tensor_parallel_size 1 or 2, not 4"):
        LLM(model=model_dirs["llama"], tensor_parallel_size=4, deterministic=True)


def test_refused_for_half_precision(model_dirs):
    with pytest.raises(ValueError, match="deterministic=True with the cpu backend runs float32 models only, not bfloat16"):
        LLM(model=model_dirs["llama"], attention_backend="cpu", dtype="bfloat16", deterministic=True)


def test_small_preset(tmp_path_factory):
    """The `small` shapes (head_dim 64, 4 query heads per KV head, a 1408-input down projection, whose
    BLAS product changes its blocking past 192 rows on one thread): alone with the whole prompt in
    one chunk, against 12 others under a 64-token budget in a pool small enough to preempt."""
    from workers.model_builder import make_model

    model = str(make_model("llama", "small", tmp_path_factory.mktemp("small") / "llama-small", seed=0))
    prompt = target_prompt()
    with engine(model, enable_prefix_caching=False, max_model_len=400, max_num_batched_tokens=400) as llm:
        alone, _ = run_with_others(llm, prompt, 0, 0)
    with engine(model, block_size=16, num_kv_blocks=40, max_model_len=400, max_num_batched_tokens=64,
                max_num_seqs=16) as llm:
        assert run_with_others(llm, prompt, 12, seed=8)[0] == alone
        assert llm.stats()["num_preemptions"] > 0
