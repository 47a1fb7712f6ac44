"""The OpenAI-compatible HTTP API as the official ``openai`` client sees it: completions and chat,
whole and streamed, n samples, several prompts, logprobs, stop strings, seeds, the prefix cache in the
usage, and vLLM's tokenizer endpoints. Greedy outputs must equal the offline ``LLM``'s."""

from __future__ import annotations

import asyncio

import pytest

from engine import SamplingParams
from engine.tokenizer import Tokenizer
from tests.serve.openai_harness import (GREEDY, MODEL, REPLICA, app, assert_error, client, http, llm,  # noqa: F401
                                        model_dir, offline, parse_metrics, prompts, reference, run)


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
        assert len(logprobs.top_logprobs[i]) == 3  # greedy: the chosen token is one of the top 3
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


def test_seeds_penalties_and_vllm_extras_equal_the_offline_engine(client, offline, run):
    """Seeded samples are independent of the batch, so each equals the offline engine's for the same
    parameters: the plain ones, and those with OpenAI's penalties and every vLLM extra."""
    prompt = "A quiet morning"
    sampled = dict(max_tokens=16, temperature=1.0, top_p=0.95)
    extras = {"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True,
              "skip_special_tokens": False, "include_stop_str_in_output": True, "cache_salt": "tenant-a"}
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.5)
    with_ids = {"return_token_ids": True}

    def offline_output(seed: int, **params):
        salt = params.pop("cache_salt", None)
        return offline.generate(prompt, SamplingParams(seed=seed, **sampled, **params), cache_salt=salt)[0].outputs[0]

    expected = [offline_output(s) for s in (7, 7, 8)]
    expected_extras = offline_output(1, **penalties, **extras)

    async def main():
        plain = await asyncio.gather(*(client.completions.create(model=MODEL, prompt=prompt, seed=s, extra_body=with_ids,
                                                                 **sampled) for s in (7, 7, 8)))
        penalized = await client.completions.create(model=MODEL, prompt=prompt, seed=1, extra_body={**extras, **with_ids},
                                                    **penalties, **sampled)
        return plain, penalized

    plain, penalized = run(main())
    for got, want in zip(plain, expected):
        assert (got.choices[0].text, got.choices[0].model_extra["token_ids"]) == (want.text, want.token_ids)
    assert expected[0].token_ids == expected[1].token_ids != expected[2].token_ids
    choice = penalized.choices[0]
    assert (choice.text, choice.model_extra["token_ids"], choice.finish_reason) == \
        (expected_extras.text, expected_extras.token_ids, "length")
    assert penalized.usage.completion_tokens == 16
    assert expected_extras.token_ids != expected[0].token_ids  # the extras changed the sample


def test_greedy_stop_token_ids_and_cache_salt_as_the_offline_engine(client, offline, run):
    """stop_token_ids ends greedy decoding where the offline engine's does (finish "stop", the id as
    stop_reason); cache_salt separates the prefix cache: the same salt hits, another salt or none misses."""
    tokens = list(range(300, 340))  # 2 full blocks of 16, used by no other test
    greedy = reference(offline, tokens, temperature=0.0, max_tokens=12, ignore_eos=True)
    stop_id = greedy.token_ids[5]
    expected = reference(offline, tokens, temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id])

    async def main():
        stopped = await client.completions.create(model=MODEL, prompt=tokens, max_tokens=12, temperature=0.0,
                                                  extra_body={"ignore_eos": True, "stop_token_ids": [stop_id],
                                                              "return_token_ids": True})
        salted = [await client.completions.create(model=MODEL, prompt=tokens, max_tokens=2, temperature=0.0,
                                                  extra_body={"cache_salt": salt})
                  for salt in ("tenant-x", "tenant-x", "tenant-y")]
        return stopped, salted

    stopped, (first_x, second_x, first_y) = run(main())
    choice = stopped.choices[0]
    assert (choice.text, choice.model_extra["token_ids"]) == (expected.text, expected.token_ids)
    assert expected.token_ids == greedy.token_ids[:expected.token_ids.index(stop_id) + 1]
    assert (choice.finish_reason, choice.stop_reason) == ("stop", stop_id)
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (first_x, second_x, first_y)]
    assert cached == [0, 32, 0]
    assert first_x.choices[0].text == second_x.choices[0].text == first_y.choices[0].text == \
        reference(offline, tokens, temperature=0.0, max_tokens=2).text


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


SWITCHED_TEMPLATE = (  # reads two chat_template_kwargs variables: a thinking switch and a refusal
    "{% if strict %}{{ raise_exception('Strict mode refuses these messages.') }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_chat_template_kwargs_reach_the_template(llm, model_dir, offline, run, tmp_path):
    """vLLM's chat_template_kwargs: /tokenize and chat completions render the model's template
    (here its chat_template.jinja, which wins over tokenizer_config.json) with them; a template's
    raise_exception and a kwarg naming a request variable are 400s."""
    import shutil

    import httpx
    import openai

    from api.http_app import build_openai_app
    from api.openai_serving import AsyncLLMClient, OpenAIServing
    from tests.serve.openai_harness import API_KEY

    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(f"{model_dir}/{name}", tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(SWITCHED_TEMPLATE)
    tokenizer = Tokenizer(tmp_path)
    serving = OpenAIServing(AsyncLLMClient(llm), tokenizer, MODEL, llm.core.config.max_model_len)
    app = build_openai_app(lambda: serving, api_key=API_KEY)
    messages = [{"role": "user", "content": "Name a colour."}]
    no_thinking = tokenizer.encode(tokenizer.apply_chat_template(messages, chat_template_kwargs={
        "enable_thinking": False}), add_special_tokens=False)
    plain = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert tokenizer.decode(no_thinking, skip_special_tokens=False).endswith("<think>\n\n</think>\n\n")
    expected = reference(offline, no_thinking, temperature=0.0, max_tokens=6, ignore_eos=True)

    async def main():
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     headers=headers) as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key=API_KEY, http_client=http, max_retries=0)
            tokens = [(await http.post("/tokenize", json={"messages": messages, **extra})).json()["tokens"]
                      for extra in ({}, {"chat_template_kwargs": {"enable_thinking": False}})]
            chat = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=6, temperature=0.0,
                extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
            refused = await http.post("/v1/chat/completions", json={
                "messages": messages, "max_tokens": 2, "chat_template_kwargs": {"strict": True}})
            reserved = await http.post("/v1/chat/completions", json={
                "messages": messages, "chat_template_kwargs": {"add_generation_prompt": False}})
            lone = await http.post("/tokenize", content=b'{"messages": [{"role": "user", "content": "x"}], '
                                   b'"chat_template_kwargs": {"name": ["\\ud800"]}}',
                                   headers={"Content-Type": "application/json"})
            return tokens, chat, refused, reserved, lone

    tokens, chat, refused, reserved, lone = run(main())
    assert tokens == [plain, no_thinking] and plain != no_thinking
    assert chat.usage.prompt_tokens == len(no_thinking) and chat.choices[0].message.content == expected.text
    assert assert_error(refused, 400, "messages")["message"] == (
        "the chat template refused the messages: Strict mode refuses these messages.")
    assert "chat_template_kwargs must not set add_generation_prompt" in assert_error(
        reserved, 400, "chat_template_kwargs")["message"]
    assert_error(lone, 400, "chat_template_kwargs")


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



def test_metrics_are_the_engines_exposition_parsed(client, http, llm, run):
    """/metrics is the Prometheus text the Serve app serves (api.metrics.prometheus_text over the
    engine's stats), read by prometheus_client's parser: one completion moves the counters by its
    exact token counts and the latency histograms by one request."""
    labels = (("model_name", MODEL), ("replica", REPLICA))

    def sample(families, name: str, **extra: str) -> float:
        wanted = (name, tuple(sorted((*labels, *extra.items()))))
        found = [samples[wanted] for _, samples in families.values() if wanted in samples]
        assert len(found) == 1, f"{name} {extra}: {len(found)} samples"
        return found[0]

    async def main():
        before = (await http.get("/metrics")).text
        result = await client.completions.create(model=MODEL, prompt="Metrics count these words", max_tokens=7,
                                                 **GREEDY)
        return before, result, (await http.get("/metrics")).text, llm.stats()

    before_text, result, after_text, stats = run(main())
    before, after = parse_metrics(before_text), parse_metrics(after_text)
    kinds = {name: kind for name, (kind, _) in after.items()}
    assert kinds["kvserve:generation_tokens"] == "counter" and kinds["kvserve:num_requests_running"] == "gauge"
    assert kinds["kvserve:e2e_request_latency_seconds"] == "histogram"

    def delta(name: str, **extra: str) -> float:
        return sample(after, name, **extra) - sample(before, name, **extra)

    assert delta("kvserve:generation_tokens_total") == result.usage.completion_tokens == 7
    assert delta("kvserve:prompt_tokens_total") == result.usage.prompt_tokens
    assert sample(after, "kvserve:generation_tokens_total") == stats["num_generation_tokens"]
    assert sample(after, "kvserve:num_requests_running") == sample(after, "kvserve:num_requests_waiting") == 0
    for histogram in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_queue_time_seconds"):
        name = f"kvserve:{histogram}"
        assert delta(f"{name}_count") == 1
        assert sample(after, f"{name}_bucket", le="+Inf") == sample(after, f"{name}_count")
    assert delta("kvserve:inter_token_latency_seconds_count") == 6  # between 7 tokens
