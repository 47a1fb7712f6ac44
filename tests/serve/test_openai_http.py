"""The OpenAI-compatible HTTP API as the official ``openai`` client sees it: completions and chat,
whole and streamed, n samples, several prompts, logprobs, stop strings, seeds, the prefix cache in the
usage, and vLLM's tokenizer endpoints. Greedy outputs must equal the offline ``LLM``'s."""

from __future__ import annotations

import asyncio

import pytest

from engine import SamplingParams
from engine.tokenizer import Tokenizer
from tests.serve.openai_harness import (GREEDY, MODEL, app, assert_error, client, http, llm,  # noqa: F401
                                        model_dir, offline, prompts, reference, run)


# --- completions -------------------------------------------------------------------------------


def test_greedy_completion_equals_offline_llm(client, offline, run):
    prompt = "The sky at sunset is"
    expected = reference(offline, prompt, temperature=0.0, max_tokens=12, ignore_eos=True)

    async def main():
        full = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY)
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY)
        return full, [chunk async for chunk in stream]

    full, chunks = run(main())
    choice = full.choices[0]
    assert (choice.text, choice.finish_reason) == (expected.text, "length")
    assert full.usage.completion_tokens == 12 and full.usage.total_tokens == full.usage.prompt_tokens + 12
    *deltas, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in deltas) == expected.text
    assert [c.choices[0].finish_reason for c in deltas] == [None] * (len(deltas) - 1) + ["length"]
    assert usage_chunk.choices == [] and usage_chunk.usage == full.usage


def test_return_token_ids_whole_and_streamed(client, offline, run):
    expected = reference(offline, "The sky at sunset is", temperature=0.0, max_tokens=8, ignore_eos=True)
    with_ids = dict(temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True})

    async def main():
        full = await client.completions.create(model=MODEL, prompt="The sky at sunset is", max_tokens=8,
                                               **with_ids)
        stream = await client.completions.create(model=MODEL, prompt="The sky at sunset is", max_tokens=8,
                                                 stream=True, **with_ids)
        return full, [chunk async for chunk in stream]

    full, chunks = run(main())
    assert full.choices[0].model_extra["token_ids"] == expected.token_ids
    streamed = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
    assert streamed == expected.token_ids and all(c.choices[0].model_extra["token_ids"] for c in chunks)
    plain = run(client.completions.create(model=MODEL, prompt="The sky at sunset is", max_tokens=2, **GREEDY))
    assert plain.choices[0].model_extra.get("token_ids") is None


def test_stream_interval_sends_fewer_larger_chunks_with_the_same_tokens(llm, model_dir, offline, run):
    """An app built with stream_interval=4: every chunk but the last carries at least 4 tokens of
    each choice, and the concatenation is the offline engine's text and tokens."""
    import httpx
    import openai

    from api.http_app import build_openai_app
    from api.openai_serving import AsyncLLMClient, OpenAIServing
    from tests.serve.openai_harness import API_KEY

    with pytest.raises(ValueError, match="stream_interval"):
        OpenAIServing(AsyncLLMClient(llm), Tokenizer(model_dir), MODEL, 64, stream_interval=0)
    serving = OpenAIServing(AsyncLLMClient(llm), Tokenizer(model_dir), MODEL, llm.core.config.max_model_len,
                            stream_interval=4)
    app = build_openai_app(lambda: serving, api_key=API_KEY)
    expected = reference(offline, "The sky at sunset is", temperature=0.0, max_tokens=10, ignore_eos=True)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as transport:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key=API_KEY, http_client=transport,
                                        max_retries=0)
            streams = [await client.completions.create(
                model=MODEL, prompt="The sky at sunset is", max_tokens=10, stream=True, n=n,
                temperature=0.0, extra_body={"ignore_eos": True, "return_token_ids": True}) for n in (1, 2)]
            return [[chunk async for chunk in stream] for stream in streams]

    single, double = run(main())
    ids = [c.choices[0].model_extra["token_ids"] for c in single]
    assert [len(i) for i in ids] == [4, 4, 2]  # 10 tokens in chunks of 4, the rest with the finish
    assert [t for i in ids for t in i] == expected.token_ids
    assert "".join(c.choices[0].text for c in single) == expected.text
    for index in (0, 1):  # n = 2: a prompt's samples flush together, when either has 4 new tokens
        mine = [c.choices[0] for c in double if c.choices[0].index == index]
        assert [t for c in mine for t in c.model_extra["token_ids"]] == expected.token_ids
        assert "".join(c.text for c in mine) == expected.text and len(mine) <= 4


def test_multiple_prompts_and_n_order_choices_by_prompt_then_sample(client, offline, prompts, run):
    batch = [prompts[1], prompts[2]]
    expected = [reference(offline, p, temperature=0.0, max_tokens=6, ignore_eos=True).text for p in batch]

    async def main():
        full = await client.completions.create(model=MODEL, prompt=batch, n=2, max_tokens=6, **GREEDY)
        stream = await client.completions.create(model=MODEL, prompt=batch, n=2, max_tokens=6, stream=True, **GREEDY)
        streamed = {}
        async for chunk in stream:
            for c in chunk.choices:
                streamed[c.index] = streamed.get(c.index, "") + c.text
        return full, streamed

    full, streamed = run(main())
    assert [c.index for c in full.choices] == [0, 1, 2, 3]
    assert [c.text for c in full.choices] == [expected[0]] * 2 + [expected[1]] * 2
    assert [streamed[i] for i in range(4)] == [c.text for c in full.choices]
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(batch[0]) + len(batch[1]), 4 * 6)


def test_completion_logprobs(client, offline, prompts, run):
    expected = reference(offline, prompts[1], temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3)
    result = run(client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=5, logprobs=3, **GREEDY))
    logprobs = result.choices[0].logprobs
    tokens = Tokenizer(offline.config.model.path)
    assert logprobs.tokens == [tokens.decode([t], skip_special_tokens=False) for t in expected.token_ids]
    for i, (token_id, top) in enumerate(zip(expected.token_ids, expected.logprobs)):
        assert logprobs.token_logprobs[i] == pytest.approx(top[token_id], abs=1e-4)
        assert len(logprobs.top_logprobs[i]) >= 3
        assert max(logprobs.top_logprobs[i].values()) == pytest.approx(logprobs.token_logprobs[i], abs=1e-4)
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(5)]


def test_echo_stop_and_max_tokens(client, offline, prompts, run):
    text = reference(offline, prompts[3], temperature=0.0, max_tokens=24, ignore_eos=True).text
    continuation = reference(offline, "Hello there", temperature=0.0, max_tokens=3, ignore_eos=True).text
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3)
                if text[i:i + 3].strip() and text.find(text[i:i + 3]) == i)

    async def main():
        stopped = await client.completions.create(model=MODEL, prompt=prompts[3], max_tokens=24, stop=[stop],
                                                  **GREEDY)
        short = await client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, echo=True, **GREEDY)
        return stopped.choices[0], short

    stopped, short = run(main())
    assert (stopped.text, stopped.finish_reason, stopped.stop_reason) == (text[:text.index(stop)], "stop", stop)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    assert short.choices[0].text == "Hello there" + continuation


def test_seed_reproducibility_penalties_and_vllm_extras(client, run):
    sampled = dict(model=MODEL, prompt="A quiet morning", max_tokens=16, temperature=1.0, top_p=0.95)
    extras = {"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True,
              "stop_token_ids": [7], "skip_special_tokens": False, "include_stop_str_in_output": True,
              "cache_salt": "tenant-a"}

    async def main():
        a, b, c = await asyncio.gather(*(client.completions.create(seed=s, **sampled) for s in (7, 7, 8)))
        penalized = await client.completions.create(seed=1, presence_penalty=0.5, frequency_penalty=0.5,
                                                    extra_body=extras, **sampled)
        return a, b, c, penalized

    a, b, c, penalized = run(main())
    assert a.choices[0].text == b.choices[0].text != c.choices[0].text
    assert penalized.usage.completion_tokens >= 2


def test_repeated_long_prompt_reports_cached_tokens(client, prompts, run):
    prompt = prompts[6]  # 129 tokens, used by no other test

    async def main():
        return [await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY) for _ in range(2)]

    first, second = run(main())
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 128  # full blocks, last token recomputed


# --- chat ----------------------------------------------------------------------------------------


def test_chat_completion_greedy_equals_offline_chat(client, offline, run):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    expected = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]

    async def main():
        full = await client.chat.completions.create(model=MODEL, messages=parts, max_completion_tokens=8, **GREEDY)
        stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, n=2, stream=True,
                                                      stream_options={"include_usage": True}, **GREEDY)
        return full, [chunk async for chunk in stream]

    full, chunks = run(main())
    assert full.choices[0].message.role == "assistant"
    assert (full.choices[0].message.content, full.choices[0].finish_reason) == (expected.text, "length")
    assert [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:2]] == [(0, "assistant"), (1, "assistant")]
    for index in range(2):
        deltas = [c.choices[0] for c in chunks[2:-1] if c.choices[0].index == index]
        assert "".join(d.delta.content for d in deltas) == expected.text
        assert [d.finish_reason for d in deltas][-1] == "length" and deltas[0].delta.role is None
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_logprobs(client, run):
    result = run(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY))
    content = result.choices[0].logprobs.content
    assert len(content) == 4 and "".join(t.token for t in content) == result.choices[0].message.content
    for token in content:
        assert token.bytes == list(token.token.encode()) and len(token.top_logprobs) == 2
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob)  # greedy picks the best


# --- tokenizer, models ---------------------------------------------------------------------------


def test_tokenize_detokenize_and_models(http, model_dir, run):
    tokenizer = Tokenizer(model_dir)

    async def main():
        ids = (await http.post("/tokenize", json={"prompt": "Hello world"})).json()
        chat = (await http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})).json()
        text = (await http.post("/detokenize", json={"tokens": ids["tokens"]})).json()
        bad = await http.post("/detokenize", json={"tokens": [-1]})
        return ids, chat, text, bad, (await http.get("/v1/models")).json()

    ids, chat, text, bad, models = run(main())
    assert ids == {"tokens": tokenizer.encode("Hello world"), "count": len(ids["tokens"]), "max_model_len": 2048}
    expected_chat = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]),
                                     add_special_tokens=False)
    assert chat["tokens"] == expected_chat
    assert text["prompt"] == tokenizer.decode(ids["tokens"], skip_special_tokens=False)
    assert text["prompt"].endswith("Hello world")
    assert_error(bad, 400, "tokens")
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 2048

