"""SamplingParams: every validation rule raises a ValueError that names the offending field, and the
normalisations users rely on (temperature 0 is greedy, top_k -1 is "no top-k", per-child seeds)."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.sampling_params import FLOAT32_MIN_NORMAL, MAX_LOGPROBS

INVALID = [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.1), "min_p"),
    (dict(logprobs=2**31), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(n=0), "n must"),
    (dict(stop=""), "stop"),
    (dict(stop=["ok", ""]), "stop"),
    (dict(stop_token_ids=[3, -1]), "stop_token_ids"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
]


@pytest.mark.parametrize("kwargs, field", INVALID, ids=[repr(k) for k, _ in INVALID])
def test_invalid_values_raise_a_clear_value_error(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(max_tokens=1), dict(max_tokens=None), dict(top_p=1.0), dict(top_p=1e-9), dict(min_p=0.0),
    dict(min_p=1.0), dict(logprobs=0), dict(logprobs=MAX_LOGPROBS + 1), dict(min_tokens=4, max_tokens=4),
    dict(min_tokens=10, max_tokens=None), dict(stop_token_ids=[0]), dict(temperature=0.0),
])
def test_boundary_values_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        if key != "temperature":
            assert getattr(params, key) == value


def test_a_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams().stop == [] and SamplingParams().stop_token_ids == []


def test_temperature_zero_is_greedy_and_drops_the_filters():
    params = SamplingParams(temperature=0.0, top_p=0.5, top_k=7, min_p=0.3)
    assert params.is_greedy
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.0, 1.0, 0, 0.0)
    assert not SamplingParams(temperature=0.7).is_greedy
    assert not SamplingParams().is_greedy  # the default temperature is 1.0, as in vLLM / OpenAI


def test_top_k_minus_one_means_disabled():
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5


def test_for_child_gives_distinct_seeds_and_n_one():
    params = SamplingParams(n=4, seed=123, temperature=0.8, top_p=0.9, max_tokens=7, stop=["x"])
    children = [params.for_child(i) for i in range(params.n)]
    assert len({c.seed for c in children}) == 4
    assert all(c.n == 1 for c in children)
    for child in children:  # everything else is inherited
        assert (child.temperature, child.top_p, child.max_tokens, child.stop) == (0.8, 0.9, 7, ["x"])
    assert params.n == 4 and params.seed == 123  # the parent is untouched
    unseeded = SamplingParams(n=3)
    assert [unseeded.for_child(i).seed for i in range(3)] == [None, None, None]


OUT_OF_RANGE = [
    (dict(top_k=9223372036854775808), "top_k"),
    (dict(top_k=2**31), "top_k"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=1.5), "top_k"),
    (dict(n=2**31), "n must"),
    (dict(n=True), "n must"),
    (dict(seed=2**63), "seed"),
    (dict(seed=-(2**63) - 1), "seed"),
    (dict(seed="7"), "seed"),
    (dict(max_tokens=2**31), "max_tokens"),
    (dict(min_tokens=2**31, max_tokens=None), "min_tokens"),
    (dict(logprobs=True), "logprobs"),
    (dict(stop_token_ids=[2**31]), "stop_token_ids"),
    (dict(stop_token_ids=["3"]), "stop_token_ids"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids"),
    (dict(stop=5), "stop"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=1e300), "temperature"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(min_p=float("nan")), "min_p"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(frequency_penalty=float("inf")), "frequency_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(repetition_penalty=1e39), "repetition_penalty"),
    # 0 or a subnormal in float32 on the workers: top_p 0 masks every token, a penalty 0 divides by 0
    (dict(top_p=1e-46), "top_p"),
    (dict(top_p=1e-40), "top_p"),
    (dict(repetition_penalty=1e-46), "repetition_penalty"),
    (dict(repetition_penalty=1e-40), "repetition_penalty"),
]


@pytest.mark.parametrize("kwargs, field", OUT_OF_RANGE, ids=[repr(k) for k, _ in OUT_OF_RANGE])
def test_values_the_workers_cannot_hold_raise_one_clean_sentence(kwargs, field):
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert "\n" not in message and len(message) < 200


@pytest.mark.parametrize("kwargs", [
    dict(top_k=2**31 - 1), dict(seed=2**63 - 1), dict(seed=-(2**63)), dict(n=2**31 - 1),
    dict(max_tokens=2**31 - 1), dict(temperature=100.0), dict(repetition_penalty=100.0),
    dict(stop_token_ids=[2**31 - 1]), dict(top_p=FLOAT32_MIN_NORMAL), dict(repetition_penalty=FLOAT32_MIN_NORMAL),
])
def test_the_edges_of_the_worker_types_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        assert getattr(params, key) == value


def test_children_of_the_largest_seed_keep_int64_seeds():
    params = SamplingParams(n=3, seed=2**63 - 1)
    assert [params.for_child(i).seed for i in range(3)] == [2**63 - 1, -(2**63), -(2**63) + 1]


def test_validate_catches_fields_changed_after_construction():
    params = SamplingParams()
    params.top_k = 2**63
    with pytest.raises(ValueError, match="top_k"):
        params.validate()


def test_the_float32_bounds_are_named_as_a_client_can_type_them():
    """The smallest normal float32 (the lowest top_p and repetition_penalty) in full: a client that
    sends the printed bound back is accepted."""
    assert FLOAT32_MIN_NORMAL == 1.1754943508222875e-38 and float(np_float32_min_normal()) == FLOAT32_MIN_NORMAL
    with pytest.raises(ValueError) as info:
        SamplingParams(top_p=1e-46)
    assert str(info.value) == "top_p must be a finite number in [1.1754943508222875e-38, 1], got 1e-46"
    with pytest.raises(ValueError) as info:
        SamplingParams(repetition_penalty=0.0)
    assert str(info.value) == "repetition_penalty must be a finite number in [1.1754943508222875e-38, 100], got 0.0"
    assert SamplingParams(top_p=1.1754943508222875e-38).top_p == FLOAT32_MIN_NORMAL


def np_float32_min_normal() -> float:
    import struct

    return struct.unpack("<f", struct.pack("<I", 0x00800000))[0]  # exponent 1, mantissa 0
