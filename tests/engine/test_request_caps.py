"""The engine's caps on what one request may ask for: configurable, refused with one clean sentence
that names the setting, before anything is registered."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.llm import engine_config
from tests.engine.test_engine_failures import FakeExecutor, make_core, run

CASES = [  # (params over the default cap, the same at the cap, the setting's name)
    (dict(n=129), dict(n=128), "max_n"),
    (dict(logprobs=21), dict(logprobs=20), "max_logprobs"),
    (dict(stop=[f"s{i}" for i in range(65)]), dict(stop=[f"s{i}" for i in range(64)]), "max_stop_sequences"),
    (dict(stop_token_ids=list(range(1025))), dict(stop_token_ids=list(range(1024))), "max_stop_token_ids"),
    (dict(stop=["x" * 1025]), dict(stop=["x" * 1024]), "max_stop_string_length"),
    (dict(stop=["x" * 1000] * 17), dict(stop=["x" * 1000] * 16), "max_stop_total_length"),
]


@pytest.mark.parametrize("over, at, setting", CASES, ids=[c[2] for c in CASES])
def test_the_default_caps(model_dirs, over, at, setting):
    core = make_core(model_dirs, FakeExecutor())
    with pytest.raises(ValueError, match=setting) as info:
        core.add_request("a", [5, 6], SamplingParams(max_tokens=2, **over))
    assert "\n" not in str(info.value)
    assert not core.outputs.requests and not core.scheduler.requests
    core.check_sampling_params(SamplingParams(max_tokens=2, **at))


def test_n_20000_is_refused_at_once(model_dirs):
    core = make_core(model_dirs, FakeExecutor())
    with pytest.raises(ValueError, match=r"^n must be at most 128 \(the engine's max_n\), got 20000$"):
        core.add_request("a", [5, 6], SamplingParams(n=20000))


def test_the_caps_are_configurable(model_dirs):
    core = make_core(model_dirs, FakeExecutor(), max_n=2, max_logprobs=3, max_stop_sequences=1,
                     max_stop_token_ids=2)
    for params, setting in [(dict(n=3), "max_n"), (dict(logprobs=4), "max_logprobs"),
                            (dict(stop=["a", "b"]), "max_stop_sequences"),
                            (dict(stop_token_ids=[1, 2, 3]), "max_stop_token_ids")]:
        with pytest.raises(ValueError, match=setting):
            core.check_sampling_params(SamplingParams(**params))
    core.add_request("a", [5, 6], SamplingParams(n=2, logprobs=3, stop=["zz"], stop_token_ids=[1, 2],
                                                  temperature=0.0, max_tokens=3, ignore_eos=True))
    assert [len(s.token_ids) for s in run(core)["a"].outputs] == [3, 3]


def test_logprobs_beyond_the_vocabulary_are_refused(model_dirs):
    core = make_core(model_dirs, FakeExecutor(), max_logprobs=10**6)
    vocab = core.config.model.vocab_size
    core.check_sampling_params(SamplingParams(logprobs=vocab))
    with pytest.raises(ValueError, match=f"logprobs must be at most {vocab}"):
        core.check_sampling_params(SamplingParams(logprobs=vocab + 1))


def test_the_stop_string_lengths_are_configurable(model_dirs):
    core = make_core(model_dirs, FakeExecutor(), max_stop_string_length=3, max_stop_total_length=5)
    with pytest.raises(ValueError, match=r"^a stop string may hold at most 3 characters \(the engine's "
                                         r"max_stop_string_length\), got 4$"):
        core.check_sampling_params(SamplingParams(stop=["abcd"]))
    with pytest.raises(ValueError, match=r"^the stop strings may hold at most 5 characters in all \(the engine's "
                                         r"max_stop_total_length\), got 6$"):
        core.check_sampling_params(SamplingParams(stop=["abc", "def"]))
    core.check_sampling_params(SamplingParams(stop=["abc", "de"]))


def test_max_logprobs_can_be_raised_above_20(model_dirs):
    core = make_core(model_dirs, FakeExecutor(), max_logprobs=40)
    core.check_sampling_params(SamplingParams(logprobs=40))
    with pytest.raises(ValueError, match=r"^logprobs must be at most 40 \(the engine's max_logprobs\), got 41$"):
        core.check_sampling_params(SamplingParams(logprobs=41))


@pytest.mark.parametrize("setting", ["max_n", "max_stop_sequences", "max_stop_token_ids", "max_stop_string_length",
                                     "max_stop_total_length"])
def test_a_cap_below_one_is_refused(model_dirs, setting):
    with pytest.raises(ValueError, match=setting):
        engine_config(model_dirs["llama"], **{setting: 0})
