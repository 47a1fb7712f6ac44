"""AsyncLLM as a streaming client sees it: deltas that add up to the offline result, concurrent streams,
a client that leaves early, abort(), bad requests next to good ones, and the output kinds.

No pytest-asyncio: each test drives its coroutine with ``asyncio.run``. The offline ``LLM`` on the same
checkpoint is the reference (its greedy output is checked against HF in test_greedy_vs_hf.py)."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM, AsyncLLM, RequestOutputKind, SamplingParams, engine_config
from tests.e2e.prompts import test_prompts as make_prompts

ARCH = "llama"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
STREAM_TIMEOUT_S = 60  # a stream that hangs fails the test instead of blocking the run


@pytest.fixture(scope="module")
def model_dir(model_dirs) -> str:
    return model_dirs[ARCH]


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    return make_prompts(model_dir)[:4]


@pytest.fixture(scope="module")
def offline(model_dir):
    with LLM(model=model_dir, num_kv_blocks=300) as llm:
        yield llm


@pytest.fixture
def engine(model_dir):
    engine = AsyncLLM(engine_config(model_dir, num_kv_blocks=300))
    yield engine
    engine.shutdown()


def reference(offline, prompt, params=GREEDY):
    inputs = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    return offline.generate(inputs, params)[0]


async def collect(engine, prompt, params, request_id, **kwargs) -> list:
    async def run():
        return [out async for out in engine.generate(prompt, params, request_id, **kwargs)]
    return await asyncio.wait_for(run(), STREAM_TIMEOUT_S)


async def until(condition, timeout_s: float = 10.0) -> None:
    """Yield to the event loop until ``condition()`` holds."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def is_clean(engine) -> bool:
    stats = engine.stats()
    return stats["num_blocks_in_use"] == 0 and stats["num_requests_running"] == 0 \
        and stats["num_requests_waiting"] == 0


def joined(deltas) -> tuple[str, list[int]]:
    return ("".join(d.outputs[0].text for d in deltas),
            [t for d in deltas for t in d.outputs[0].token_ids])


def assert_stream(deltas, expected) -> None:
    """Deltas of one request: only the last is finished, and together they are ``expected``."""
    assert deltas and all(not d.finished for d in deltas[:-1]) and deltas[-1].finished
    assert all(d.outputs[0].finish_reason is None for d in deltas[:-1])
    final = expected.outputs[0]
    assert joined(deltas) == (final.text, final.token_ids)
    last = deltas[-1].outputs[0]
    assert (last.finish_reason, last.stop_reason) == (final.finish_reason, final.stop_reason)
    assert all(d.prompt_token_ids == expected.prompt_token_ids for d in deltas)


@pytest.mark.parametrize("kind", ["text", "ids"])
def test_streamed_deltas_add_up_to_the_offline_output(engine, offline, prompts, kind):
    prompt = "The sky at sunset is" if kind == "text" else prompts[2]
    expected = reference(offline, prompt)
    deltas = asyncio.run(collect(engine, prompt, GREEDY, "r1"))
    assert_stream(deltas, expected)
    assert len(deltas) == GREEDY.max_tokens  # one delta per step, one token each
    assert all(len(d.outputs[0].token_ids) == 1 for d in deltas)
    assert is_clean(engine)


def test_stop_string_while_streaming(engine, offline, prompts):
    full = reference(offline, prompts[1], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    text = full.outputs[0].text
    stop = next(text[i:i + 3] for i in range(6, len(text) - 3)
                if text[i:i + 3].isascii() and text[i:i + 3].strip() and text.find(text[i:i + 3]) == i)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    expected = reference(offline, prompts[1], params)
    assert expected.outputs[0].finish_reason == "stop" and expected.outputs[0].text == text[:text.index(stop)]
    deltas = asyncio.run(collect(engine, prompts[1], params, "stopper"))
    assert_stream(deltas, expected)
    sent = ""
    for delta in deltas:  # no delta ever carried a character of the stop string
        sent += delta.outputs[0].text
        assert expected.outputs[0].text.startswith(sent)


def test_concurrent_streams_interleave_and_are_each_correct(engine, offline, prompts):
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (6, 12, 9, 15)]
    expected = [reference(offline, p, sp) for p, sp in zip(prompts, params)]
    arrivals: list[str] = []

    async def stream(i):
        deltas = []
        async for out in engine.generate(prompts[i], params[i], f"req-{i}"):
            arrivals.append(out.request_id)
            deltas.append(out)
        return deltas

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(stream(i) for i in range(4))), STREAM_TIMEOUT_S)

    results = asyncio.run(main())
    for deltas, exp in zip(results, expected):
        assert_stream(deltas, exp)
    # every stream had its first delta before any stream had its last: they ran side by side
    first = {r: arrivals.index(r) for r in set(arrivals)}
    last = {r: len(arrivals) - 1 - arrivals[::-1].index(r) for r in set(arrivals)}
    assert max(first.values()) < min(last.values())
    assert is_clean(engine)


def test_leaving_the_stream_early_aborts_the_request(engine, offline, prompts):
    long = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)

    async def main():
        seen = 0
        async for _ in engine.generate(prompts[0], long, "leaver"):
            seen += 1
            if seen == 3:
                break
        await until(lambda: is_clean(engine))
        # the request was ended, not run to completion; its id is free again
        assert engine.stats()["num_generation_tokens"] < 100
        return await collect(engine, prompts[2], GREEDY, "leaver")

    deltas = asyncio.run(main())
    assert_stream(deltas, reference(offline, prompts[2]))
    assert is_clean(engine)


def test_abort_ends_the_stream_with_finish_reason_abort(engine, offline, prompts):
    long = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)

    async def victim():
        deltas = []
        async for out in engine.generate(prompts[1], long, "victim"):
            deltas.append(out)
            if len(deltas) == 3:
                engine.abort("victim")
        return deltas

    async def main():
        bystander = asyncio.ensure_future(collect(engine, prompts[2], GREEDY, "bystander"))
        deltas = await asyncio.wait_for(victim(), STREAM_TIMEOUT_S)
        return deltas, await bystander

    deltas, bystander = asyncio.run(main())
    last = deltas[-1]
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert all(not d.finished for d in deltas[:-1])
    text, tokens = joined(deltas)
    assert 3 <= len(tokens) < 100
    expected = reference(offline, prompts[1], SamplingParams(temperature=0.0, max_tokens=len(tokens), ignore_eos=True))
    assert (text, tokens) == (expected.outputs[0].text, expected.outputs[0].token_ids)
    assert_stream(bystander, reference(offline, prompts[2]))
    assert is_clean(engine)


def test_invalid_request_raises_at_once_and_spares_the_others(engine, offline, prompts):
    bad_requests = [
        ([5] * 3000, GREEDY, "bad"),  # longer than max_model_len
        ([], GREEDY, "bad"),  # empty
        ([5, 4096], GREEDY, "bad"),  # a token id past the vocab
        (prompts[0], SamplingParams(min_tokens=2, stop_token_ids=[5000]), "bad"),  # a stop id past the vocab
        (prompts[0], GREEDY, "good"),  # the id of a request in flight
        (prompts[0], GREEDY, ""),  # no id
    ]

    async def main():
        good = asyncio.ensure_future(collect(engine, prompts[3], GREEDY, "good"))
        await until(lambda: engine.stats()["num_generation_tokens"] > 0)
        for prompt, params, request_id in bad_requests:
            stream = engine.generate(prompt, params, request_id)
            with pytest.raises(ValueError):
                # raised by the first step of the generator, before it ever waits for the engine
                stream.__anext__().send(None)
        return await good, await collect(engine, prompts[0], GREEDY, "bad")

    good, reused = asyncio.run(main())
    assert_stream(good, reference(offline, prompts[3]))
    assert_stream(reused, reference(offline, prompts[0]))
    assert is_clean(engine)


def test_final_only_yields_one_output(engine, offline, prompts):
    expected = reference(offline, prompts[1])
    outs = asyncio.run(collect(engine, prompts[1], GREEDY, "final", output_kind=RequestOutputKind.FINAL_ONLY))
    assert len(outs) == 1 and outs[0].finished
    assert (outs[0].outputs[0].text, outs[0].outputs[0].token_ids) == \
        (expected.outputs[0].text, expected.outputs[0].token_ids)


def test_cumulative_outputs_grow(engine, offline, prompts):
    expected = reference(offline, prompts[1]).outputs[0]
    outs = asyncio.run(collect(engine, prompts[1], GREEDY, "cumulative", output_kind=RequestOutputKind.CUMULATIVE))
    assert [o.outputs[0].token_ids for o in outs] == [expected.token_ids[:i + 1] for i in range(len(outs))]
    assert outs[-1].finished and outs[-1].outputs[0].text == expected.text
