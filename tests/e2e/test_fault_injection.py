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


POISON_SEED = 666  # a greedy request with this seed makes the poisoned sampler raise


class PoisonedSampler:
    """Wraps rank 0's sampler: raises when a row of the batch is the poisoned request (marked by its
    seed) and has ``after`` output tokens, as a sampler would on a value it cannot handle."""

    def __init__(self, llm, after: int = 0) -> None:
        runner = llm.core.executor.worker.runner
        self.inner, self.after, self.raised = runner.sampler, after, 0
        runner.sampler = self

    def __call__(self, logits, rows, *args, **kwargs):
        if any(r.params.seed == POISON_SEED and r.num_output_tokens >= self.after for r in rows):
            self.raised += 1
            raise OverflowError("Python int too large to convert to C long")
        return self.inner(logits, rows, *args, **kwargs)


def poisoned(n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens, ignore_eos=True, seed=POISON_SEED, n=n)


@pytest.mark.parametrize("after", [0, 3], ids=["in-prefill", "mid-decode"])
def test_a_request_that_fails_the_sampler_fails_alone(llama, hf_oracle, after):
    prompts = make_prompts(llama)
    oracle = hf_oracle("llama")
    with LLM(model=llama, attention_backend="torch") as llm:
        sampler = PoisonedSampler(llm, after)
        inputs = [{"prompt_token_ids": p} for p in prompts]
        params = [GREEDY] * len(prompts)
        inputs.insert(3, {"prompt_token_ids": prompts[2]})
        params.insert(3, poisoned())
        outs = llm.generate(inputs, params)
        bad = outs.pop(3)
        assert bad.finished and bad.outputs[0].finish_reason == "error"
        assert bad.error == "the engine failed while running this request (OverflowError)"
        assert len(bad.outputs[0].token_ids) == after
        assert all(o.error is None for o in outs)
        check_greedy(oracle, prompts, outs)
        stats = llm.stats()
        # one failed step of every request, then the requests of that step one at a time until the
        # poisoned one failed alone
        assert stats["num_failed_requests"] == 1 and stats["num_failed_steps"] == 2
        assert sampler.raised == 2
        assert stats["num_blocks_in_use"] == 0 and stats["num_requests_running"] == 0
        # the same engine serves the prompts again, from a cache the failures did not poison
        hits = stats["prefix_cache_hits"]
        again = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        check_greedy(oracle, prompts, again)
        assert llm.stats()["prefix_cache_hits"] - hits == sum((len(p) - 1) // 16 * 16 for p in prompts)


def test_every_sample_of_a_failed_request_ends_and_nothing_leaks(llama, hf_oracle):
    prompts = make_prompts(llama)[2:5]
    with LLM(model=llama, attention_backend="torch") as llm:
        PoisonedSampler(llm, after=2)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts] + [{"prompt_token_ids": prompts[0]}],
                            [GREEDY] * len(prompts) + [poisoned(n=3)])
        bad = outs.pop()
        assert [s.finish_reason for s in bad.outputs] == ["error"] * 3 and bad.error is not None
        check_greedy(hf_oracle("llama"), prompts, outs)
        assert llm.stats()["num_blocks_in_use"] == 0


def test_the_async_engine_fails_the_stream_of_that_request_only(llama, hf_oracle):
    import asyncio

    from engine import AsyncLLM, RequestFailedError
    from engine.llm import engine_config

    prompts = make_prompts(llama)[1:5]
    engine = AsyncLLM(engine_config(llama, attention_backend="torch"))
    runner = engine.core.executor.worker.runner

    class Holder:  # PoisonedSampler reads llm.core.executor.worker.runner
        core = engine.core
    PoisonedSampler(Holder, after=1)

    async def collect(i, prompt, params):
        tokens = []
        async for out in engine.generate(prompt, params, request_id=f"r{i}"):
            tokens += out.outputs[0].token_ids
        return tokens

    async def main():
        jobs = [collect(i, p, GREEDY) for i, p in enumerate(prompts)]
        jobs.append(collect("bad", prompts[0], poisoned()))
        return await asyncio.gather(*jobs, return_exceptions=True)

    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    assert isinstance(results[-1], RequestFailedError)
    assert str(results[-1]) == "the engine failed while running this request (OverflowError)"
    for prompt, tokens in zip(prompts, results[:-1]):
        assert len(tokens) == GREEDY.max_tokens
        hf_oracle("llama").assert_greedy(prompt, tokens)
    assert runner.sampler.raised == 2
    assert engine.stats()["num_blocks_in_use"] == 0


@pytest.mark.parametrize("fail_on", [1, 4], ids=["prefill-step", "decode-step"])
def test_a_step_that_raises_once_costs_no_request(llama, hf_oracle, fail_on):
    """A transient failure (an executor raising on step k): the step's requests, run one at a time,
    all succeed, and every request completes with the tokens it would have produced."""
    prompts = make_prompts(llama)
    oracle = hf_oracle("llama")
    with LLM(model=llama, attention_backend="torch") as llm:
        faulty = FaultyExecutor(llm.core, RuntimeError("CUDA error: an illegal memory access"), {fail_on})
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        check_greedy(oracle, prompts, outs)
        stats = llm.stats()
        assert stats["num_failed_steps"] == 1 and stats["num_failed_requests"] == 0
        # one failed step, one step per request of it alone, then the normal steps: a prompt-only
        # first step plus one step per further token (the isolation steps gave each request one)
        assert faulty.calls == 1 + len(prompts) + GREEDY.max_tokens - 1
        hits = stats["prefix_cache_hits"]
        again = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        check_greedy(oracle, prompts, again)
        assert llm.stats()["prefix_cache_hits"] - hits == sum((len(p) - 1) // 16 * 16 for p in prompts)
