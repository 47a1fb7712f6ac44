"""Sampling end to end on the tiny llama, judged by Hugging Face where a reference exists: seeds,
filters that collapse to greedy, the sampled distribution and penalties (stopping: test_stopping.py;
bad input and chat: test_llm_input.py)."""

from __future__ import annotations

import collections

import pytest
import torch

from engine import LLM, SamplingParams
from tests.e2e.sampling_common import (  # noqa: F401 (fixtures)
    GREEDY,
    MAX_TOKENS,
    SEEDED,
    as_inputs,
    assert_clean,
    tokens_of,
    greedy,
    llm,
    model_dir,
    oracle,
    prompts,
)


# --- seeds ------------------------------------------------------------------------------------------


def test_seeded_sampling_does_not_depend_on_the_batch(llm, prompts, greedy):
    target = {"prompt_token_ids": prompts[2]}
    alone = llm.generate(target, SamplingParams(seed=1234, **SEEDED))[0].outputs[0].token_ids
    assert len(alone) == MAX_TOKENS and alone != greedy[2]  # it really sampled

    batch = [
        ([prompts[4], prompts[1], prompts[2], prompts[2], prompts[0]],
         [SamplingParams(seed=7, **SEEDED), SamplingParams(**SEEDED), SamplingParams(seed=1234, **SEEDED),
          SamplingParams(**SEEDED), SamplingParams(seed=1, temperature=1.0, max_tokens=3)], 2),
        ([prompts[2], prompts[3], prompts[0]],
         [SamplingParams(seed=1234, **SEEDED), SamplingParams(n=3, **SEEDED), SamplingParams(seed=9, **SEEDED)], 0),
    ]
    results = [llm.generate(as_inputs(batch_prompts), params) for batch_prompts, params, _ in batch]
    for outs, (_, _, index) in zip(results, batch):
        assert outs[index].outputs[0].token_ids == alone
    assert results[0][3].outputs[0].token_ids != alone  # the unseeded copy of the same prompt

    other_seed = llm.generate(target, SamplingParams(seed=1235, **SEEDED))[0].outputs[0].token_ids
    assert other_seed != alone
    assert_clean(llm)


def test_seeded_sampling_survives_preemption(llm, model_dir, prompts):
    """A pool too small for the batch: requests are preempted and recomputed, and seeded samples do
    not change (each draw depends on the seed and the output position only)."""
    params = [SamplingParams(seed=100 + i, **SEEDED) for i in range(len(prompts))]
    expected = tokens_of(llm.generate(as_inputs(prompts), params))
    with LLM(model=model_dir, num_kv_blocks=30, max_model_len=400, max_num_batched_tokens=64,
             max_num_seqs=8) as small:
        assert tokens_of(small.generate(as_inputs(prompts), params)) == expected
        assert small.stats()["num_preemptions"] > 0
        assert_clean(small)


def test_n_samples_with_a_seed_differ_and_reproduce(llm, prompts):
    params = SamplingParams(n=2, seed=42, **SEEDED)
    first = llm.generate({"prompt_token_ids": prompts[1]}, params)[0]
    assert [s.index for s in first.outputs] == [0, 1]
    a, b = (s.token_ids for s in first.outputs)
    assert a != b and len(a) == len(b) == MAX_TOKENS
    again = llm.generate(as_inputs([prompts[3], prompts[1]]), [SamplingParams(**SEEDED), params])[1]
    assert [s.token_ids for s in again.outputs] == [a, b]


def test_unseeded_sampling_follows_the_engine_seed(model_dir, prompts):
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)

    def run(seed):
        with LLM(model=model_dir, seed=seed, num_kv_blocks=300) as engine:
            return tokens_of(engine.generate(as_inputs(prompts), params))

    first = run(123)
    assert run(123) == first
    assert run(124) != first


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(min_p=1.0), dict(top_p=1e-6)],
                         ids=["top_k=1", "min_p=1", "top_p=1e-6"])
def test_filters_that_keep_one_token_are_greedy(llm, prompts, greedy, filters):
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, **filters)
    assert tokens_of(llm.generate(as_inputs(prompts), params)) == greedy


# --- the sampled distribution ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", [None, 0], ids=["unseeded", "seeded"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_first_token_follows_the_model_distribution(llm, oracle, prompts, seed, temperature):
    """800 samples of the first token with top_k=3 against HF's softmax(logits / T) renormalised
    over its top 3. Chi-square with 2 degrees of freedom: 30 is exceeded with probability 3e-7."""
    prompt = prompts[2]  # its top 3 are fairly even: every cell expects many samples (checked below)
    top = oracle.logits(prompt)[-1].topk(3)
    expected = torch.softmax(top.values / temperature, 0).tolist()
    num_samples = 800
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(n=num_samples, seed=seed, temperature=temperature, top_k=3, max_tokens=1))[0]
    counts = collections.Counter(s.token_ids[0] for s in out.outputs)
    assert len(out.outputs) == num_samples
    assert set(counts) <= set(top.indices.tolist())  # top_k: nothing outside the top 3
    assert min(expected) * num_samples > 50
    chi2 = sum((counts[t] - num_samples * q) ** 2 / (num_samples * q) for t, q in zip(top.indices.tolist(), expected))
    assert chi2 < 30, (dict(counts), expected)
    assert_clean(llm)


# --- penalties ------------------------------------------------------------------------------------


def repetition(penalty: float):
    def penalize(row, prompt_ids, history):
        seen = torch.tensor(sorted(set(prompt_ids + history)))
        values = row[seen]
        row[seen] = torch.where(values > 0, values / penalty, values * penalty)
        return row
    return penalize


def presence_frequency(presence: float, frequency: float):
    def penalize(row, prompt_ids, history):
        counts = torch.zeros_like(row)
        for token in history:
            counts[token] += 1
        return row - frequency * counts - presence * (counts > 0).float()
    return penalize


@pytest.mark.parametrize("kwargs, penalize", [
    (dict(repetition_penalty=1.3), repetition(1.3)),
    (dict(presence_penalty=0.5, frequency_penalty=0.7), presence_frequency(0.5, 0.7)),
], ids=["repetition", "presence+frequency"])
def test_penalties_match_hf_by_teacher_forcing(llm, oracle, prompts, greedy, kwargs, penalize):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)
    # a plain greedy request shares the batch: penalties must not leak into it
    outs = llm.generate(as_inputs(prompts + [prompts[0]]), [params] * len(prompts) + [GREEDY])
    penalised = tokens_of(outs[:-1])
    for prompt, tokens in zip(prompts, penalised):
        oracle.assert_greedy(prompt, tokens, penalize=penalize)
    assert outs[-1].outputs[0].token_ids == greedy[0]
    assert sum(p != g for p, g in zip(penalised, greedy)) >= 2  # the penalty changed the outputs
