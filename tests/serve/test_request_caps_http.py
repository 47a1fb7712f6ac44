"""The caps on one HTTP request and the fields that used to be accepted and ignored: prompts per
completion request, body bytes (413 before parsing, by Content-Length or as a chunked body grows),
max_logprobs raised above 20, stop string lengths, priority, truncate_prompt_tokens and prompt_logprobs
(vLLM's shape, equal to the engine's values; their entries capped by max_prompt_logprobs_entries)."""

from __future__ import annotations

import httpx
import pytest

from api.http_app import build_openai_app
from api.openai_serving import AsyncLLMClient, OpenAIServing
from engine import AsyncLLM, SamplingParams, engine_config
from engine.tokenizer import Tokenizer
from tests.serve.openai_harness import API_KEY, MODEL, assert_error, model_dir, offline, run  # noqa: F401

MAX_PROMPTS, MAX_BODY, MAX_LOGPROBS, MAX_PL_ENTRIES = 3, 4096, 30, 400


@pytest.fixture(scope="module")
def llm(model_dir, run):  # noqa: F811 - after `run`: shut down before the loop closes
    engine = AsyncLLM(engine_config(model_dir, num_kv_blocks=400, max_logprobs=MAX_LOGPROBS,
                                  max_prompt_logprobs_entries=MAX_PL_ENTRIES))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def http(llm, model_dir, run):  # noqa: F811
    serving = OpenAIServing(AsyncLLMClient(llm), Tokenizer(model_dir), MODEL, llm.core.config.max_model_len,
                            max_prompts_per_request=MAX_PROMPTS, max_logprobs=MAX_LOGPROBS)
    app = build_openai_app(lambda: serving, api_key=API_KEY, max_body_bytes=MAX_BODY)
    raw = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                            headers={"Authorization": f"Bearer {API_KEY}"})
    yield raw
    run(raw.aclose())


def complete(http, run, **body) -> httpx.Response:
    return run(http.post("/v1/completions", json={"model": MODEL, "max_tokens": 2, "temperature": 0.0, **body}))


def test_prompts_per_request_are_capped(http, run):
    assert complete(http, run, prompt=["a", "b", "c"]).status_code == 200
    error = assert_error(complete(http, run, prompt=["a", "b", "c", "d"]), 400, "prompt")
    assert error["message"] == ("a completion request may hold at most 3 prompts (the server's "
                                "max_prompts_per_request), got 4")
    assert_error(complete(http, run, prompt=[[5, 6]] * 4), 400, "prompt")


def test_a_body_over_the_cap_is_refused_before_it_is_parsed(http, run):
    big = b"{" + b" " * MAX_BODY + b"not even json"
    error = assert_error(run(http.post("/v1/completions", content=big)), 413)
    assert error["message"] == (f"the request body may hold at most {MAX_BODY} bytes (the server's "
                                f"max_request_body_bytes), got {len(big)} bytes")
    assert error["code"] == "request_too_large"

    async def chunks():  # no Content-Length: a chunked body that grows past the cap
        for _ in range(10):
            yield b" " * 1000

    error = assert_error(run(http.post("/v1/completions", content=chunks())), 413)
    assert error["message"].endswith("got more than that")
    assert complete(http, run, prompt="x", user="u" * 3500).status_code == 200  # under the cap: served


def test_max_logprobs_raised_above_20(http, run):
    body = complete(http, run, prompt="The sky", logprobs=MAX_LOGPROBS).json()
    assert [len(top) for top in body["choices"][0]["logprobs"]["top_logprobs"]] in ([30, 30], [31, 30], [30, 31],
                                                                                     [31, 31])
    error = assert_error(complete(http, run, prompt="The sky", logprobs=31), 400, "logprobs")
    assert error["message"] == "logprobs must be at most 30 (the server's max_logprobs), got 31"
    chat = run(http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "logprobs": True,
                                                       "top_logprobs": 25, "messages": [{"role": "user",
                                                                                         "content": "hi"}]}))
    assert len(chat.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 25


def test_stop_strings_are_capped_in_length(http, run):
    error = assert_error(complete(http, run, prompt="x", stop=["y" * 1025]), 400)
    assert "max_stop_string_length" in error["message"]
    assert complete(http, run, prompt="x", stop=["y" * 1000]).status_code == 200


def test_priority_other_than_0_is_refused(http, run):
    error = assert_error(complete(http, run, prompt="x", priority=1), 400, "priority")
    assert "priority other than 0 is not supported" in error["message"]
    assert complete(http, run, prompt="x", priority=0).status_code == 200


def test_truncate_prompt_tokens_keeps_the_last_tokens(http, run, model_dir):  # noqa: F811
    ids = Tokenizer(model_dir).encode("The quick brown fox jumps over the lazy dog, and then it runs away")
    cut = complete(http, run, prompt=ids, truncate_prompt_tokens=5, max_tokens=6,
                   ignore_eos=True, return_token_ids=True).json()
    sent = complete(http, run, prompt=ids[-5:], max_tokens=6, ignore_eos=True, return_token_ids=True).json()
    assert cut["usage"]["prompt_tokens"] == 5
    assert cut["choices"][0]["token_ids"] == sent["choices"][0]["token_ids"]
    text = complete(http, run, prompt="The quick brown fox jumps over", truncate_prompt_tokens=3, echo=True).json()
    assert text["usage"]["prompt_tokens"] == 3
    chat = run(http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "truncate_prompt_tokens": 4,
                                                       "messages": [{"role": "user", "content": "hello there"}]}))
    assert chat.json()["usage"]["prompt_tokens"] == 4
    assert_error(complete(http, run, prompt="x", truncate_prompt_tokens=0), 400, "truncate_prompt_tokens")
    error = assert_error(complete(http, run, prompt="x", truncate_prompt_tokens=10**6), 400, "truncate_prompt_tokens")
    assert error["message"].startswith("truncate_prompt_tokens must be at most max_model_len")


def test_prompt_logprobs_in_vllm_shape(http, run, offline):  # noqa: F811
    prompts = [[5, 17, 300, 41, 9], [8, 8, 120]]
    body = complete(http, run, prompt=prompts, n=2, prompt_logprobs=2).json()
    expected = [out.prompt_logprobs for out in offline.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))]
    assert len(body["choices"]) == 4
    for choice in body["choices"]:  # choice i of prompt p has index p * n + i
        entries, prompt = choice["prompt_logprobs"], prompts[choice["index"] // 2]
        assert len(entries) == len(prompt) and entries[0] is None
        for entry, reference in zip(entries[1:], expected[choice["index"] // 2][1:]):
            assert {int(t) for t in entry} == set(reference)
            for token_id, value in entry.items():
                assert set(value) == {"logprob", "rank", "decoded_token"}
                assert value["logprob"] == pytest.approx(reference[int(token_id)][0], abs=1e-5)
                assert value["rank"] == reference[int(token_id)][1]
    chat = run(http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "prompt_logprobs": 0,
                                                       "messages": [{"role": "user", "content": "hi"}]})).json()
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    assert chat["usage"]["prompt_tokens"] == len(chat["prompt_logprobs"])
    error = assert_error(complete(http, run, prompt="x", prompt_logprobs=1, stream=True), 400)
    assert "prompt_logprobs are not available when stream is true" in error["message"]
    assert_error(complete(http, run, prompt="x", prompt_logprobs=31), 400, "prompt_logprobs")


def test_prompt_logprobs_entries_are_capped(http, run):
    prompt = [(7 * i) % 200 + 5 for i in range(150)]
    error = assert_error(complete(http, run, prompt=prompt[:101], prompt_logprobs=3, max_tokens=1), 400)
    assert error["message"] == ("prompt_logprobs may return at most 400 entries (the engine's "
                                "max_prompt_logprobs_entries), got 101 prompt tokens x 4 = 404")
    body = complete(http, run, prompt=prompt[:100], prompt_logprobs=3, max_tokens=1).json()  # at the cap
    assert len(body["choices"][0]["prompt_logprobs"]) == 100
    assert all(len(e) in (4, 5) for e in body["choices"][0]["prompt_logprobs"][1:])
    # n = 2: each choice carries them, so they count twice
    error = assert_error(complete(http, run, prompt=prompt[:51], prompt_logprobs=3, max_tokens=1, n=2), 400)
    assert error["message"] == ("prompt_logprobs may return at most 400 entries (the engine's "
                                "max_prompt_logprobs_entries), got 51 prompt tokens x 4 x n=2 = 408")
    body = complete(http, run, prompt=prompt[:50], prompt_logprobs=3, max_tokens=1, n=2).json()
    assert [len(c["prompt_logprobs"]) for c in body["choices"]] == [50, 50]
    # truncate_prompt_tokens first: the engine counts the prompt it is given
    body = complete(http, run, prompt=prompt, truncate_prompt_tokens=100, prompt_logprobs=3, max_tokens=1).json()
    assert body["usage"]["prompt_tokens"] == 100 and len(body["choices"][0]["prompt_logprobs"]) == 100


def test_the_app_arguments_carry_the_caps():
    from cluster.app_args import AppArgs

    args = AppArgs(max_prompts_per_request=8, max_request_body_bytes=1000,
                   engine_kwargs={"max_logprobs": 64, "max_stop_string_length": 10})
    assert (args.max_prompts_per_request, args.max_request_body_bytes, args.max_logprobs,
            args.max_stop_string_length) == (8, 1000, 64, 10)
    for name in ("max_prompts_per_request", "max_request_body_bytes"):
        with pytest.raises(ValueError, match=name):
            AppArgs(**{name: 0})
