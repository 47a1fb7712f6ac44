"""Sampling, stopping and bad input, end to end on the tiny llama, judged by Hugging Face where a
reference exists: seeds, filters that collapse to greedy, the sampled distribution, penalties, every
way a request stops, input errors that leave the engine clean, and the chat template."""

from __future__ import annotations

import collections
import string

import pytest
import torch

from engine import LLM, SamplingParams
from tests.e2e.prompts import corpus_ids
from tests.e2e.prompts import test_prompts as make_prompts

ARCH = "llama"
EOS_IDS = (2, 4)
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = dict(temperature=0.8, top_p=0.9, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(model_dirs) -> str:
    return model_dirs[ARCH]


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model=model_dir, num_kv_blocks=600, max_n=800) as engine:  # 800 samples of one prompt
        yield engine


@pytest.fixture(scope="module")
def oracle(hf_oracle):
    return hf_oracle(ARCH)


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    return make_prompts(model_dir)[:5]


@pytest.fixture(scope="module")
def greedy(llm, prompts) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (checked against HF in test_greedy_vs_hf.py)."""
    return [o.outputs[0].token_ids for o in llm.generate(as_inputs(prompts), GREEDY)]


def as_inputs(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def tokens_of(outputs) -> list[list[int]]:
    return [s.token_ids for o in outputs for s in o.outputs]


def assert_clean(llm):
    stats = llm.stats()
    assert stats["num_blocks_in_use"] == 0
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0


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


# --- bad input ------------------------------------------------------------------------------------

BAD_INPUTS = {
    "too long": ([{"prompt_token_ids": [5] * 2049}], None, "max_model_len"),
    "empty": ([{"prompt_token_ids": []}], None, "empty"),
    "id >= vocab": ([{"prompt_token_ids": [5, 4096, 6]}], None, "4096"),
    "negative id": ([{"prompt_token_ids": [5, -1]}], None, "4096"),
    "params count": ([{"prompt_token_ids": [5, 6]}] * 2, [GREEDY] * 3, "sampling params"),
    "stop id >= vocab": ([{"prompt_token_ids": [5, 6]}],
                         SamplingParams(min_tokens=2, max_tokens=4, stop_token_ids=[5000]), "stop_token_ids"),
    "not a prompt": ([{"text": "hi"}], None, "prompt"),
    "one bad in a batch": ([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7]}, {"prompt_token_ids": []}],
                           None, "empty"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_and_leaves_the_engine_clean(llm, prompts, greedy, case):
    inputs, params, message = BAD_INPUTS[case]
    before = llm.stats()
    with pytest.raises(ValueError, match=message):
        llm.generate(inputs, params)
    after = llm.stats()
    # nothing ran: no step, no prompt token scheduled, nothing allocated or queued
    for key in ("num_steps", "num_prompt_tokens", "num_generation_tokens"):
        assert after[key] == before[key], key
    assert_clean(llm)
    assert tokens_of(llm.generate(as_inputs(prompts[:2]), GREEDY)) == greedy[:2]


# --- chat -------------------------------------------------------------------------------------------


def test_chat_renders_the_template(llm):
    tokenizer = llm.get_tokenizer()
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0.0, max_tokens=4))[0]
    rendered = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert out.prompt_token_ids[0] == 3 and out.prompt_token_ids.count(4) == 1  # <|im_start|>, <|im_end|>
    assert 1 <= len(out.outputs[0].token_ids) <= 4

    two = llm.chat([[{"role": "user", "content": "hi"}],
                    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]],
                   SamplingParams(temperature=0.0, max_tokens=2))
    assert two[0].prompt_token_ids == out.prompt_token_ids
    assert two[1].prompt_token_ids == tokenizer.encode(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False)


def test_chat_passes_tools_and_template_kwargs(model_dir, tmp_path):
    """LLM.chat hands ``tools`` and ``chat_template_kwargs`` to the template (one that uses both)."""
    import shutil

    local = tmp_path / "model"
    shutil.copytree(model_dir, local)
    (local / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if tools %}tools: {{ tools | map(attribute='name') | join(',') }}\n{% endif %}"
        "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}no-think\n{% endif %}")
    with LLM(model=str(local), num_kv_blocks=64, max_model_len=256) as small:
        tokenizer = small.get_tokenizer()
        params = SamplingParams(temperature=0.0, max_tokens=1)
        out = small.chat([{"role": "user", "content": "hi"}], params, tools=[{"name": "add"}, {"name": "mul"}],
                         chat_template_kwargs={"enable_thinking": False})[0]
        plain = small.chat([{"role": "user", "content": "hi"}], params)[0]
    head = "<|im_start|>user\nhi<|im_end|>\n"
    assert out.prompt_token_ids == tokenizer.encode(head + "tools: add,mul\n<|im_start|>assistant\nno-think\n",
                                                    add_special_tokens=False)
    assert plain.prompt_token_ids == tokenizer.encode(head + "<|im_start|>assistant\n", add_special_tokens=False)
