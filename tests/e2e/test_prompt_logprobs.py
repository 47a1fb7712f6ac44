"""prompt_logprobs end to end on the tiny llama (tp = 1), against Hugging Face's log_softmax of its
logits at each prompt position (teacher forcing): in one prefill, across chunked prefill, on a second
request whose prefix the cache holds (it takes no hit for the part whose logprobs it needs), and beside
n > 1 samples."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.e2e.prompts import test_prompts as make_prompts

ARCH = "llama"
TOL = 1e-4


def params(k: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=k, **kwargs)


@pytest.fixture(scope="module")
def prompt(model_dirs) -> list[int]:
    return make_prompts(model_dirs[ARCH])[3]  # 320 tokens


@pytest.fixture(scope="module")
def reference(hf_oracle, prompt):
    return hf_oracle(ARCH).log_softmax(prompt)


def check(prompt_logprobs, prompt: list[int], reference, k: int) -> None:
    """One entry per prompt token, the first None; each holds the prompt token with its HF logprob and
    rank, and the HF top k with ranks 1..k."""
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for position, entry in enumerate(prompt_logprobs[1:], start=1):
        row = reference[position - 1]
        token = prompt[position]
        logprob, rank = entry[token]
        assert logprob == pytest.approx(float(row[token]), abs=TOL)
        # 1 + the tokens more likely: exact up to the tokens within TOL of it (the tiny model's rows are flat)
        assert 1 + int((row > row[token] + TOL).sum()) <= rank <= 1 + int((row > row[token] - TOL).sum())
        top = row.topk(k)
        ranked = sorted(((r, t, lp) for t, (lp, r) in entry.items() if t != token or r <= k))
        assert [r for r, _, _ in ranked][:k] == list(range(1, k + 1))
        assert [lp for _, _, lp in ranked][:k] == pytest.approx(top.values.tolist(), abs=TOL)
        assert len(entry) in (k, k + 1)


@pytest.fixture(scope="module")
def llm(model_dirs):
    with LLM(model=model_dirs[ARCH], block_size=16) as engine:  # prefix caching on, prompts in one prefill
        yield engine


@pytest.fixture(scope="module")
def chunked(model_dirs):
    # chunks of at most 48 tokens, their logits in slices of max_num_seqs = 16 rows
    with LLM(model=model_dirs[ARCH], enable_prefix_caching=False, max_num_batched_tokens=48,
             max_num_seqs=16) as engine:
        yield engine


def test_prompt_logprobs_match_hf_in_one_prefill_and_chunked(llm, chunked, prompt, reference):
    for engine in (llm, chunked):
        out = engine.generate({"prompt_token_ids": prompt}, params(3))[0]
        check(out.prompt_logprobs, prompt, reference, 3)
    # the chunked prefill ran in 7 chunks of at most 48 tokens: every position was still covered
    assert chunked.core.scheduler.stats.num_steps >= 7


def test_a_prefix_cache_hit_is_not_taken_for_the_logprobs_it_would_skip(llm, prompt, reference):
    first = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert first.prompt_logprobs is None
    second = llm.generate({"prompt_token_ids": prompt}, params(2))[0]
    check(second.prompt_logprobs, prompt, reference, 2)
    assert second.num_cached_tokens == 0
    # once they are computed, the same prompt without them hits the cache again
    third = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert third.num_cached_tokens == 304
    assert [o.token_ids for o in second.outputs] == [o.token_ids for o in first.outputs]


def test_prompt_logprobs_with_n_samples_and_k_zero(llm, prompt, reference):
    out = llm.generate({"prompt_token_ids": prompt}, params(0, n=3))[0]
    assert [len(o.token_ids) for o in out.outputs] == [2, 2, 2]
    assert all(len(entry) == 1 for entry in out.prompt_logprobs[1:])
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry[prompt[position]][0] == pytest.approx(float(reference[position - 1][prompt[position]]), abs=TOL)


def test_prompt_logprobs_over_max_logprobs_are_refused(llm):
    with pytest.raises(ValueError, match=r"^prompt_logprobs must be at most 20 \(the engine's max_logprobs\), "
                                         r"got 21$"):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, params(21))
