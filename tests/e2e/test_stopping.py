"""Every way a request stops, end to end on the tiny llama, judged by Hugging Face where a reference
exists: max_tokens, stop token ids, stop strings, eos (ignored or not), min_tokens, max_model_len."""

from __future__ import annotations

import string

import pytest

from engine import LLM, SamplingParams
from tests.e2e.prompts import corpus_ids
from tests.e2e.sampling_common import (  # noqa: F401 (fixtures)
    EOS_IDS,
    MAX_TOKENS,
    as_inputs,
    assert_clean,
    greedy,
    llm,
    model_dir,
    oracle,
    prompts,
)


# --- stopping -------------------------------------------------------------------------------------


def test_max_tokens_ends_with_length(llm, prompts, greedy):
    outs = llm.generate(as_inputs(prompts), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    for out, full in zip(outs, greedy):
        sample = out.outputs[0]
        assert sample.token_ids == full[:5]
        assert (sample.finish_reason, sample.stop_reason) == ("length", None)


@pytest.mark.parametrize("include", [False, True], ids=["cut", "include"])
def test_stop_token_ids(llm, prompts, greedy, include):
    tokenizer = llm.get_tokenizer()
    checked = 0
    for prompt, full in zip(prompts, greedy):
        # a token whose first occurrence is a few tokens in
        j = next((j for j in range(3, len(full)) if full[j] not in full[:j] and full[j] not in EOS_IDS), None)
        if j is None:
            continue
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[full[j]],
                                include_stop_str_in_output=include)
        sample = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
        assert sample.token_ids == full[:j + 1]  # the stop token is the last token
        assert (sample.finish_reason, sample.stop_reason) == ("stop", full[j])
        # as in vLLM, its text is left out unless include_stop_str_in_output
        assert sample.text == tokenizer.decode(full[:j + 1] if include else full[:j])
        checked += 1
    assert checked >= 3


def two_token_stop(tokenizer, tokens: list[int]) -> tuple[str, int, int]:
    """A printable stop string made of the last 2 characters of one generated token and the first 2 of
    the next, that first occurs there: (stop, where it starts in the text, how many tokens end it)."""
    text = tokenizer.decode(tokens)
    printable = set(string.ascii_letters + string.digits + string.punctuation + " ")
    for m in range(2, len(tokens) - 1):
        head, with_next = tokenizer.decode(tokens[:m]), tokenizer.decode(tokens[:m + 1])
        b = len(head)
        if not text.startswith(with_next) or len(with_next) < b + 2 or b < 2:
            continue
        stop = text[b - 2:b + 2]
        if set(stop) <= printable and stop.strip() and text.find(stop) == b - 2:
            return stop, b - 2, m + 1
    raise LookupError


@pytest.mark.parametrize("include", [False, True], ids=["cut", "include"])
def test_stop_strings(llm, prompts, greedy, include):
    tokenizer = llm.get_tokenizer()
    checked = 0
    for prompt, full in zip(prompts, greedy):
        try:
            stop, start, num_tokens = two_token_stop(tokenizer, full)
        except LookupError:
            continue
        text = tokenizer.decode(full)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                stop=["never-in-the-text", stop], include_stop_str_in_output=include)
        sample = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
        assert sample.text == text[:start + (len(stop) if include else 0)]
        assert (sample.finish_reason, sample.stop_reason) == ("stop", stop)
        assert sample.token_ids == full[:num_tokens]  # generation ended with the token that completed it
        # completed by the last token max_tokens allows: the stop string still is the reason
        params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True, stop=[stop],
                                include_stop_str_in_output=include)
        last = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
        assert (last.text, last.token_ids) == (sample.text, sample.token_ids)
        assert (last.finish_reason, last.stop_reason) == ("stop", stop)
        checked += 1
    assert checked >= 3
    assert_clean(llm)


@pytest.fixture(scope="module")
def eos_prompt(model_dir, oracle) -> list[int]:
    """A corpus prefix whose greedy next token is an eos id, by a clear margin (found with HF)."""
    ids = corpus_ids(f"{model_dir}/tokenizer.json")
    for start in range(0, len(ids), 512):
        window = list(ids[start:start + 512])
        top = oracle.logits(window).topk(2, dim=-1)
        for j in range(len(window)):
            if int(top.indices[j, 0]) in EOS_IDS and float(top.values[j, 0] - top.values[j, 1]) > 0.1:
                return window[:j + 1]
    raise AssertionError("no corpus prefix makes the tiny llama say eos")


def test_eos_stops_unless_ignored(llm, oracle, eos_prompt):
    inputs = {"prompt_token_ids": eos_prompt}
    sample = llm.generate(inputs, SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0]
    assert sample.token_ids[0] in EOS_IDS and len(sample.token_ids) == 1
    assert (sample.finish_reason, sample.stop_reason) == ("stop", None)
    assert sample.text == ""  # a special token, skipped
    # as in vLLM, the eos text is not output even when special tokens are, unless asked for
    for include in (False, True):
        params = SamplingParams(temperature=0.0, max_tokens=8, skip_special_tokens=False,
                                include_stop_str_in_output=include)
        sample = llm.generate(inputs, params)[0].outputs[0]
        eos_text = llm.get_tokenizer().id_to_token(sample.token_ids[0])
        assert sample.text == (eos_text if include else "") and eos_text in ("</s>", "<|im_end|>")

    sample = llm.generate(inputs, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert sample.token_ids[0] in EOS_IDS and len(sample.token_ids) == 8
    assert sample.finish_reason == "length"
    oracle.assert_greedy(eos_prompt, sample.token_ids)


def mask_until(ids, min_tokens):
    def penalize(row, prompt_ids, history):
        if len(history) < min_tokens:
            row[list(ids)] = float("-inf")
        return row
    return penalize


def test_min_tokens_masks_eos_until_reached(llm, oracle, eos_prompt):
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3)
    sample = llm.generate({"prompt_token_ids": eos_prompt}, params)[0].outputs[0]
    assert not set(sample.token_ids[:3]) & set(EOS_IDS)
    oracle.assert_greedy(eos_prompt, sample.token_ids, penalize=mask_until(EOS_IDS, 3))
    if len(sample.token_ids) < 8:
        assert sample.token_ids[-1] in EOS_IDS and sample.finish_reason == "stop"
    else:
        assert sample.finish_reason == "length"


def test_min_tokens_masks_stop_token_ids_until_reached(llm, oracle, prompts, greedy):
    prompt, first = prompts[1], greedy[1][0]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, min_tokens=2,
                            stop_token_ids=[first])
    sample = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
    assert first not in sample.token_ids[:2]
    oracle.assert_greedy(prompt, sample.token_ids, penalize=mask_until([first], 2))
    if first in sample.token_ids:
        assert sample.token_ids.index(first) == len(sample.token_ids) - 1
        assert (sample.finish_reason, sample.stop_reason) == ("stop", first)
    else:
        assert sample.finish_reason == "length"
    # without min_tokens the same request stops at once
    sample = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[first]))[0].outputs[0]
    assert sample.token_ids == [first] and sample.finish_reason == "stop"


def test_max_model_len_caps_the_output(model_dir, prompts):
    prompt = prompts[2]  # 33 tokens
    with LLM(model=model_dir, max_model_len=40, num_kv_blocks=16) as small:
        sample = small.generate({"prompt_token_ids": prompt},
                                SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))[0].outputs[0]
        assert len(prompt) + len(sample.token_ids) == 40
        assert sample.finish_reason == "length"
        with pytest.raises(ValueError, match="max_model_len"):
            small.generate({"prompt_token_ids": prompt + prompt})
        assert_clean(small)
