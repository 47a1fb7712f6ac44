"""prompt_logprobs at tensor_parallel_size 2: every rank runs the LM head over the prompt rows (it
gathers to rank 0), so the step stays in lockstep and the values equal Hugging Face's, chunked."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.e2e.prompts import test_prompts as make_prompts


def test_tp2_prompt_logprobs_match_hf_across_chunks(ray_cluster, model_dirs, hf_oracle):
    prompt = make_prompts(model_dirs["llama"])[2]  # 33 tokens, in chunks of 16
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    with LLM(model=model_dirs["llama"], tensor_parallel_size=2, max_num_batched_tokens=16) as llm:
        out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    reference = hf_oracle("llama").log_softmax(prompt)
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        row, token = reference[position - 1], prompt[position]
        assert entry[token][0] == pytest.approx(float(row[token]), abs=1e-4)
        top = sorted((r, lp) for t, (lp, r) in entry.items() if t != token or r <= 2)[:2]
        assert [lp for _, lp in top] == pytest.approx(row.topk(2).values.tolist(), abs=1e-4)
    hf_oracle("llama").assert_greedy(prompt, out.outputs[0].token_ids)
