"""Fuzzing the OpenAI HTTP API (the real app over an in-process engine, tests/serve/openai_harness.py):
every malformed request gets a 4xx with the OpenAI error body, never a 5xx or a hang, and a good
request running beside the malformed ones returns exactly the offline engine's text.

Three parts: hypothesis strategies over the completions and chat schemas (each example breaks a valid
body in one to three ways: numbers out of range or of the wrong type, huge integers, NaN and
infinities, lone surrogates, empty and oversized lists, unknown roles, missing fields); a hand list of
the requests that once failed other requests or went unanswered; and the ``benchmarks.fuzz`` driver
with a small count (its figures with a large count come from ``python -m benchmarks.fuzz``).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.fuzz import GOOD_BODY, GOOD_PROMPT, fuzz, is_error_body, malformed_case
from tests.serve.openai_harness import (app, http, llm, model_dir, offline, reference, run,  # noqa: F401
                                        until_clean)

TIMEOUT_S = 30  # a request without an answer by then hangs
INT32_MAX, INT64_MIN, INT64_MAX = 2**31 - 1, -(2**63), 2**63 - 1
ROLES = ("system", "developer", "user", "assistant", "tool")
INT_FIELDS = {"n": (1, INT32_MAX), "max_tokens": (1, INT32_MAX), "min_tokens": (0, INT32_MAX),
              "top_k": (-1, INT32_MAX), "seed": (INT64_MIN, INT64_MAX)}
FLOAT_FIELDS = {"temperature": (0.0, 100.0, False), "top_p": (0.0, 1.0, True), "min_p": (0.0, 1.0, False),
                "presence_penalty": (-2.0, 2.0, False), "frequency_penalty": (-2.0, 2.0, False),
                "repetition_penalty": (0.0, 100.0, True)}


@pytest.fixture(scope="module")
def expected(offline) -> str:
    """What the good request beside the malformed ones must return."""
    return reference(offline, GOOD_PROMPT, temperature=0.0, max_tokens=GOOD_BODY["max_tokens"], ignore_eos=True).text


# --- strategies: values no schema field of that kind accepts ---------------------------------------

words = st.text(alphabet=string.ascii_letters, min_size=1, max_size=8)  # never a number, even to pydantic
lone_surrogate = st.integers(0xD800, 0xDFFF).map(chr)
surrogate_text = st.builds(lambda a, s, b: a + s + b, st.text(max_size=6), lone_surrogate, st.text(max_size=6))
containers = st.one_of(st.lists(st.integers(), min_size=1, max_size=3), st.dictionaries(words, st.integers(), max_size=2))
fractions = st.one_of(st.floats(-1e9, 1e9).map(lambda x: math.floor(x) + 0.5), st.sampled_from([math.nan, math.inf,
                                                                                               -math.inf]))


def bad_ints(low: int, high: int) -> st.SearchStrategy:
    """Outside [low, high] (huge ones included, beyond int64), or not an integer at all."""
    return st.one_of(st.integers(max_value=low - 1), st.integers(min_value=high + 1),
                     st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**400]).filter(lambda v: not low <= v <= high),
                     fractions, words, containers)


def bad_floats(low: float, high: float, low_open: bool) -> st.SearchStrategy:
    """Outside the range (its open end included), NaN, infinities, beyond float64, or not a number."""
    below = st.floats(max_value=low, allow_nan=False).filter(lambda x: x <= low if low_open else x < low)
    above = st.floats(min_value=high, exclude_min=True, allow_nan=False)
    return st.one_of(below, above, st.sampled_from([math.nan, math.inf, -math.inf, 10**400, -(10**400)]),
                     words.filter(lambda w: w.lower() not in ("inf", "nan", "infinity")), containers)


bad_texts = st.one_of(surrogate_text, st.integers(), st.floats(allow_nan=False), containers)
token_ids = st.lists(st.integers(0, 4000), max_size=40)


def bad_token_ids(vocab_size: int) -> st.SearchStrategy:
    """A list of ids with one outside the vocabulary (and beyond int32, int64, uint64)."""
    bad_id = st.one_of(st.integers(max_value=-1), st.integers(vocab_size, INT32_MAX), st.integers(min_value=2**31),
                       st.sampled_from([2**63, 2**64]))
    return st.builds(lambda head, bad, tail: head + [bad] + tail, token_ids, bad_id, token_ids)


def setter(key: str, values: st.SearchStrategy) -> st.SearchStrategy:
    return values.map(lambda v: (f"{key}={v!r:.60}", lambda body: body.__setitem__(key, v)))


def _last_message(body: dict) -> dict:
    """The last message to break, or a throwaway when an earlier mutation broke the list already."""
    messages = body.get("messages")
    return messages[-1] if isinstance(messages, list) and messages and isinstance(messages[-1], dict) else {}


def in_message(key: str, values: st.SearchStrategy) -> st.SearchStrategy:
    return values.map(lambda v: (f"messages[-1].{key}={v!r:.60}", lambda body: _last_message(body).__setitem__(key, v)))


def remover(key: str) -> st.SearchStrategy:
    return st.just((f"no {key}", lambda body: body.pop(key, None)))


def sampling_mutations() -> list[st.SearchStrategy]:
    return [*(setter(name, bad_ints(*bounds)) for name, bounds in INT_FIELDS.items()),
            *(setter(name, bad_floats(*bounds)) for name, bounds in FLOAT_FIELDS.items()),
            setter("stop", st.one_of(bad_texts, st.lists(surrogate_text, min_size=1, max_size=3), st.just(""),
                                     st.just([""]))),
            setter("stop_token_ids", st.one_of(bad_token_ids(4096), st.lists(words, min_size=1, max_size=2),
                                               st.integers())),
            setter("cache_salt", bad_texts), setter("model", st.one_of(bad_texts, words.map(lambda w: "gpt-" + w))),
            setter("logit_bias", st.dictionaries(st.integers(0, 100).map(str), st.floats(allow_nan=False),
                                                 min_size=1, max_size=3)),
            setter("stream", st.one_of(words.filter(lambda w: w.lower() not in ("true", "false", "yes", "no", "on",
                                                                                "off", "t", "f", "y", "n")),
                                       containers))]


def completion_requests(vocab_size: int) -> st.SearchStrategy:
    prompt = st.one_of(st.text(max_size=30), token_ids.filter(bool), st.lists(st.text(max_size=10), min_size=1,
                                                                               max_size=3))
    base = st.builds(lambda p, m: {"prompt": p, "max_tokens": m}, prompt, st.integers(1, 4))
    mutation = st.one_of(
        *sampling_mutations(),
        setter("logprobs", bad_ints(0, 20)),
        setter("prompt", st.one_of(surrogate_text, st.lists(surrogate_text, min_size=1, max_size=2),
                                   bad_token_ids(vocab_size), st.lists(bad_token_ids(vocab_size), min_size=1, max_size=2),
                                   st.sampled_from([[], [[]], [[5], []], None, 5, [1.5], [[[1]]], ["a", 1]]),
                                   st.integers(2049, 8000).map(lambda n: [5] * n))),
        setter("best_of", st.integers(2, 10)), setter("suffix", words),
        st.just(("echo with logprobs", lambda body: body.update(echo=True, logprobs=1))),
        remover("prompt"))
    return st.builds(_apply, st.just("/v1/completions"), base, st.lists(mutation, min_size=1, max_size=3))


def chat_requests() -> st.SearchStrategy:
    message = st.builds(lambda r, c: {"role": r, "content": c}, st.sampled_from(ROLES[:3]), st.text(max_size=20))
    base = st.builds(lambda ms, m: {"messages": ms, "max_tokens": m}, st.lists(message, min_size=1, max_size=3),
                     st.integers(1, 4))
    mutation = st.one_of(
        *sampling_mutations(),
        setter("max_completion_tokens", bad_ints(1, INT32_MAX)),
        st.tuples(st.just(None), bad_ints(0, 20)).map(
            lambda t: (f"top_logprobs={t[1]!r:.60}", lambda body: body.update(logprobs=True, top_logprobs=t[1]))),
        st.integers(1, 20).map(lambda v: (f"top_logprobs={v} without logprobs",
                                          lambda body: body.update(logprobs=False, top_logprobs=v))),
        in_message("content", st.one_of(bad_texts, st.lists(st.fixed_dictionaries(
            {"type": st.just("text"), "text": surrogate_text}), min_size=1, max_size=2),
            st.lists(st.fixed_dictionaries({"type": words.filter(lambda w: w != "text")}), min_size=1, max_size=2))),
        in_message("name", bad_texts),
        in_message("role", st.one_of(st.text(max_size=10).filter(lambda r: r not in ROLES), st.integers(),
                                     st.none(), surrogate_text)),
        st.just(("message without a role", lambda body: _last_message(body).pop("role", None))),
        setter("messages", st.one_of(st.just([]), st.lists(st.one_of(st.integers(), words, st.lists(st.integers())),
                                                            min_size=1, max_size=3), st.none(), words)),
        setter("messages", st.integers(2100, 4000).map(lambda n: [{"role": "user", "content": "word " * n}])),
        setter("tools", st.sampled_from([[{"type": "function"}], [{"type": "function", "function": {"name": ""}}],
                                         [{"type": "function", "function": {"name": "f", "parameters": 5}}]])),
        setter("response_format", st.sampled_from([{"type": "xml"}, {"type": "json_schema"},
                                                   {"type": "json_schema", "json_schema": {"name": "x"}}])),
        remover("messages"))
    return st.builds(_apply, st.just("/v1/chat/completions"), base, st.lists(mutation, min_size=1, max_size=3))


def _apply(path: str, body: dict, mutations: list[tuple[str, object]]) -> tuple[str, bytes, str]:
    for _, mutate in mutations:
        mutate(body)
    what = "; ".join(description for description, _ in mutations)
    return path, json.dumps(body, allow_nan=True, ensure_ascii=True).encode(), what


async def _post(http, path: str, body: bytes) -> object:
    return await asyncio.wait_for(http.post(path, content=body, headers={"Content-Type": "application/json"}),
                                  TIMEOUT_S)


def _check_beside_good(http, llm, run, expected: str, bad: list[tuple[str, bytes, str]]) -> None:
    """Send ``bad`` while a good greedy completion runs; each gets a 4xx with an error body, the good one
    returns ``expected``, and the engine ends clean."""
    async def main():
        good = asyncio.ensure_future(asyncio.wait_for(http.post("/v1/completions", json=GOOD_BODY), TIMEOUT_S))
        await asyncio.sleep(0)  # the good request starts first
        responses = await asyncio.gather(*(_post(http, path, body) for path, body, _ in bad))
        return responses, await good

    responses, good = run(main())
    for (path, body, what), response in zip(bad, responses):
        assert 400 <= response.status_code < 500 and is_error_body(response), \
            f"{path} {what}: {response.status_code} {response.text[:300]}"
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == expected
    run(until_clean(llm))


# --- property-based ---------------------------------------------------------------------------------

FUZZ_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                         print_blob=True)


@FUZZ_SETTINGS
@given(bad=st.lists(completion_requests(4096), min_size=1, max_size=6))
def test_malformed_completions_get_4xx_beside_a_good_request(http, llm, run, expected, bad):
    _check_beside_good(http, llm, run, expected, bad)


@FUZZ_SETTINGS
@given(bad=st.lists(chat_requests(), min_size=1, max_size=6))
def test_malformed_chat_requests_get_4xx_beside_a_good_request(http, llm, run, expected, bad):
    _check_beside_good(http, llm, run, expected, bad)


def test_the_strategies_vocabulary_is_the_models(llm):
    """The strategies' out-of-vocabulary ids start at the tiny model's vocabulary size."""
    assert llm.core.config.model.vocab_size == 4096


# --- the hand list --------------------------------------------------------------------------------

HAND_LIST = [  # (path, raw JSON body, param the error names)
    ("/v1/completions", '{"prompt": "Hello", "max_tokens": 4, "top_k": 9223372036854775808}', "top_k"),
    ("/v1/completions", json.dumps({"prompt": [5] * 20 + [2**64] + [5] * 20, "max_tokens": 4}), "prompt"),
    ("/v1/completions", json.dumps({"prompt": [5] * 16 + [2**63] * 16, "max_tokens": 4}), "prompt"),
    ("/v1/completions", '{"prompt": "\\ud800"}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    ("/v1/completions", '{"prompt": "x", "seed": 18446744073709551616}', "seed"),
    ("/v1/completions", '{"prompt": "x", "temperature": NaN}', "temperature"),
    ("/v1/completions", '{"prompt": "x", "top_p": Infinity}', "top_p"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 1e999}', "max_tokens"),
    ("/v1/completions", '{"prompt": "x", "stop_token_ids": [4294967296]}', "stop_token_ids"),
    ("/v1/completions", '{"prompt": "x", "stop_token_ids": [4096]}', None),  # the engine's vocabulary check
    ("/v1/completions", '{"prompt": [[5, 6], []]}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "wizard", "content": "x"}]}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"content": "x"}]}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "logprobs": true, '
                             '"top_logprobs": 1000000}', "top_logprobs"),
]


@pytest.mark.parametrize("path, body, param", HAND_LIST)
def test_the_hand_list_gets_400_beside_a_good_request(http, llm, run, expected, path, body, param):
    _check_beside_good(http, llm, run, expected, [(path, body.encode(), body)])
    response = run(_post(http, path, body.encode()))
    error = response.json()["error"]
    assert (response.status_code, error["param"], error["type"]) == (400, param, "invalid_request_error")


@pytest.mark.parametrize("body, message", [
    ({"prompt": "x", "n": 20000, "max_tokens": 4}, "n must be at most 128 (the engine's max_n), got 20000"),
    ({"prompt": "x", "stop": [f"s{i}" for i in range(1000)]},
     "at most 64 stop strings are allowed (the engine's max_stop_sequences), got 1000"),
])
def test_unbounded_work_is_refused_at_once_in_one_sentence(http, llm, run, expected, body, message):
    """20000 samples or 1000 stop strings are over the engine's caps (defaults): the engine's ValueError
    reaches the client as a 400 whose message is its one sentence, beside a good request."""
    _check_beside_good(http, llm, run, expected, [("/v1/completions", json.dumps(body).encode(), message)])
    response = run(_post(http, "/v1/completions", json.dumps(body).encode()))
    assert response.status_code == 400 and response.json()["error"] == {
        "message": message, "type": "invalid_request_error", "param": None, "code": 400}


# --- the benchmark driver, small ------------------------------------------------------------------

def test_fuzz_driver_reports_every_malformed_request_answered_cleanly(http, llm, run, expected):
    rng = random.Random(1)
    cases = [malformed_case(rng) for _ in range(300)]
    report = run(fuzz(http, cases, expected, concurrency=16, timeout_s=TIMEOUT_S))
    assert report.tried == 300 and report.good >= 1
    assert (report.error_body_4xx, report.bad_4xx, report.server_errors, report.accepted, report.hangs,
            report.collateral) == (300, 0, 0, 0, 0, 0), report.failures
    run(until_clean(llm))
