"""Faults injected into a real engine (the tiny checkpoints, the in-process executor): a step that
raises or is interrupted leaves no wrong KV in the prefix cache, and the engine afterwards serves
the tokens Hugging Face transformers computes (teacher forcing)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.e2e.prompts import test_prompts as make_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


class FaultyExecutor:
    """Wraps an engine's executor: ``execute_model`` raises ``error`` on the calls numbered in
    ``fail_on`` (1-based) before the ranks see the step, and runs the real step otherwise."""

    def __init__(self, core, error: BaseException, fail_on: set[int]) -> None:
        self.inner = core.executor
        self.error = error
        self.fail_on = fail_on
        self.calls = 0
        core.executor = self

    def execute_model(self, scheduler_output):
        self.calls += 1
        if self.calls in self.fail_on:
            raise self.error
        return self.inner.execute_model(scheduler_output)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def check_greedy(oracle, prompts, outs, max_tokens=GREEDY.max_tokens):
    for prompt, out in zip(prompts, outs):
        sample = out.outputs[0]
        assert len(sample.token_ids) == max_tokens and sample.finish_reason == "length"
        oracle.assert_greedy(prompt, sample.token_ids)


@pytest.fixture(scope="module")
def llama(model_dirs):
    return model_dirs["llama"]


def test_an_interrupted_first_step_leaves_nothing_in_the_prefix_cache(llama, hf_oracle):
    """Ctrl-C in the step that plans every prompt: its full blocks were entered into the cache at
    planning, but their KV never written. Afterwards the same prompts hit only what was computed."""
    prompts = make_prompts(llama)
    with LLM(model=llama, attention_backend="torch") as llm:
        faulty = FaultyExecutor(llm.core, KeyboardInterrupt(), {1})
        with pytest.raises(KeyboardInterrupt):
            llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        stats = llm.stats()
        assert stats["num_cached_blocks"] == 0
        assert stats["num_blocks_in_use"] == 0 and stats["num_requests_running"] == 0
        assert not llm.core.has_unfinished_requests()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert faulty.calls > 1
        check_greedy(hf_oracle("llama"), prompts, outs)
        # the rerun computed its tokens (all but each last one), so their full blocks are cached now;
        # the 300-token prefix two prompts share is cached once
        computed = [len(p) + GREEDY.max_tokens - 1 for p in prompts]
        assert llm.stats()["num_cached_blocks"] == sum(n // 16 for n in computed) - 300 // 16


def test_an_interrupted_decode_step_keeps_the_computed_prompts(llama, hf_oracle):
    """Interrupted after the prompts were computed: their blocks stay cached (their KV exists) and a
    rerun hits them; the tokens still match."""
    prompts = make_prompts(llama)[2:5]
    block = 16
    with LLM(model=llama, attention_backend="torch", block_size=block) as llm:
        FaultyExecutor(llm.core, KeyboardInterrupt(), {3})
        with pytest.raises(KeyboardInterrupt):
            llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        before = llm.stats()
        assert before["num_blocks_in_use"] == 0
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        check_greedy(hf_oracle("llama"), prompts, outs)
        after = llm.stats()
        # every full prompt block (one token short of the prompt) is a hit on the rerun
        assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == \
            sum((len(p) - 1) // block * block for p in prompts)
