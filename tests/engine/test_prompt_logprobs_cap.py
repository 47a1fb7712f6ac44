"""max_prompt_logprobs_entries: prompt tokens x (prompt_logprobs + 1) of one request, refused at admission
with one sentence naming the setting; times n, as a completion response repeats them in each choice."""

from __future__ import annotations

import pytest

from cluster.app_args import AppArgs
from engine import LLM, SamplingParams
from engine.async_engine import AsyncLLM
from engine.config import EngineConfig
from engine.llm import engine_config
from tests.engine.test_engine_failures import FakeExecutor, make_core, run


def test_the_default_cap_is_100k_entries(model_dirs):
    core = make_core(model_dirs, FakeExecutor())
    assert EngineConfig.max_prompt_logprobs_entries == core.config.max_prompt_logprobs_entries == 100_000
    core.check_sampling_params(SamplingParams(prompt_logprobs=20), 4761)  # 99981 entries
    with pytest.raises(ValueError) as info:
        core.check_sampling_params(SamplingParams(prompt_logprobs=20), 4762)
    assert str(info.value) == ("prompt_logprobs may return at most 100000 entries (the engine's "
                               "max_prompt_logprobs_entries), got 4762 prompt tokens x 21 = 100002")
    core.check_sampling_params(SamplingParams(prompt_logprobs=0), 100_000)
    with pytest.raises(ValueError, match="max_prompt_logprobs_entries"):
        core.check_sampling_params(SamplingParams(prompt_logprobs=0), 100_001)
    core.check_sampling_params(SamplingParams(), 10**6)  # without prompt_logprobs: no bound here


def test_refused_at_admission_with_nothing_registered(model_dirs):
    core = make_core(model_dirs, FakeExecutor(), max_prompt_logprobs_entries=30)
    with pytest.raises(ValueError) as info:
        core.add_request("a", list(range(5, 16)), SamplingParams(max_tokens=1, prompt_logprobs=2))
    assert str(info.value) == ("prompt_logprobs may return at most 30 entries (the engine's "
                               "max_prompt_logprobs_entries), got 11 prompt tokens x 3 = 33")
    assert not core.outputs.requests and not core.scheduler.requests
    # times n: 6 tokens x 3 x 2 = 36 refused, 5 x 3 x 2 = 30 (the cap) accepted and served
    with pytest.raises(ValueError) as info:
        core.add_request("b", list(range(5, 11)), SamplingParams(max_tokens=1, n=2, prompt_logprobs=2))
    assert str(info.value) == ("prompt_logprobs may return at most 30 entries (the engine's "
                               "max_prompt_logprobs_entries), got 6 prompt tokens x 3 x n=2 = 36")
    core.add_request("b", list(range(5, 10)), SamplingParams(max_tokens=1, n=2, prompt_logprobs=2))
    assert [len(s.token_ids) for s in run(core)["b"].outputs] == [1, 1]


def test_the_offline_and_async_engines_refuse_it_before_adding(model_dirs):
    kwargs = dict(num_kv_blocks=64, block_size=4, max_model_len=128, max_prompt_logprobs_entries=30)
    llm = LLM(model_dirs["llama"], **kwargs)
    try:
        with pytest.raises(ValueError, match=r"max_prompt_logprobs_entries\), got 16 prompt tokens x 2 = 32$"):
            llm.generate([{"prompt_token_ids": [5] * 15}, {"prompt_token_ids": [5] * 16}],
                         SamplingParams(max_tokens=1, prompt_logprobs=1))
        assert not llm.core.outputs.requests
    finally:
        llm.shutdown()
    engine = AsyncLLM(engine_config(model_dirs["llama"], **kwargs))
    try:
        with pytest.raises(ValueError, match=r"max_prompt_logprobs_entries\), got 31 prompt tokens x 1 = 31$"):
            engine.submit("a", [5] * 31, SamplingParams(max_tokens=1, prompt_logprobs=0), lambda *a: None)
    finally:
        engine.shutdown()


def test_the_app_arguments_carry_it(model_dirs):
    assert AppArgs().max_prompt_logprobs_entries == 100_000
    assert AppArgs(max_prompt_logprobs_entries=7).max_prompt_logprobs_entries == 7
    assert AppArgs(engine_kwargs={"max_prompt_logprobs_entries": 9}).max_prompt_logprobs_entries == 9
    with pytest.raises(ValueError, match="max_prompt_logprobs_entries must be a positive integer, got 0"):
        engine_config(model_dirs["llama"], max_prompt_logprobs_entries=0)
