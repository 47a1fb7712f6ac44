"""Tool calls the server reads out of the text a model writes (``tool_choice: "auto"``), through the real
FastAPI app and the official ``openai`` client, over a scripted engine that writes a given text in small
pieces: the message's content and calls, ``finish_reason``, each ``tool_call_parser``, and streamed
pieces that the SDK assembles into the non-streamed message. No model runs."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from api.http_app import build_openai_app
from api.openai_serving import OpenAIServing
from engine.messages import CompletionOutput, RequestOutput
from engine.tokenizer import Tokenizer

MODEL = "scripted"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time"}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris and the time?"}]
HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
LLAMA = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
CALLS = [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]


class ScriptedEngine:
    """Writes ``text`` three characters per step (n samples alike), then finishes with ``finish_reason``;
    records the prompts and params it was given."""

    def __init__(self) -> None:
        self.text, self.finish_reason, self.requests = "", "stop", []

    async def generate(self, request_id, prompt_token_ids, params, cache_salt) -> AsyncIterator[RequestOutput]:
        self.requests.append((prompt_token_ids, params))
        pieces = [self.text[i:i + 3] for i in range(0, len(self.text), 3)] or [""]
        for step, piece in enumerate(pieces):
            last = step == len(pieces) - 1
            yield RequestOutput(request_id, None, prompt_token_ids, [
                CompletionOutput(i, piece, [step], self.finish_reason if last else None) for i in range(params.n)],
                last)
            await asyncio.sleep(0)

    async def abort(self, request_id: str) -> None:
        pass


@pytest.fixture(scope="module")
def run():
    with asyncio.Runner() as runner:
        yield runner.run


@pytest.fixture(scope="module")
def served(model_dirs, run):
    """(engine, {tool_call_parser: client}) on one scripted engine."""
    engine, tokenizer, clients, transports = ScriptedEngine(), Tokenizer(model_dirs["llama"]), {}, []
    for parser in ("generic", "hermes", "llama3_json"):
        serving = OpenAIServing(engine, tokenizer, MODEL, 2048, tool_call_parser=parser)
        transport = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_openai_app(lambda s=serving: s)))
        transports.append(transport)
        clients[parser] = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=transport,
                                             max_retries=0)
    yield engine, clients
    for transport in transports:
        run(transport.aclose())


def ask(served, run, text: str, parser: str = "generic", finish_reason: str = "stop", **fields):
    """The non-streamed completion and the SDK's assembly of the streamed one, and the stream's chunks."""
    engine, clients = served
    engine.text, engine.finish_reason = text, finish_reason
    body = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, **fields)

    async def main():
        whole = await clients[parser].chat.completions.create(**body)
        stream = await clients[parser].chat.completions.create(**body, stream=True)
        return whole, [chunk async for chunk in stream]

    whole, chunks = run(main())
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    # the SDK refuses to finish a completion cut by the length limit: its snapshot is the assembly
    streamed = state.current_completion_snapshot if finish_reason == "length" else state.get_final_completion()
    return whole, streamed, chunks


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]


@pytest.mark.parametrize("parser, text, content", [
    ("generic", HERMES, "Let me look.\n"),
    ("hermes", HERMES, "Let me look.\n"),
    ("generic", LLAMA, None),
    ("llama3_json", LLAMA, None),
])
def test_calls_in_the_text_become_tool_calls_whole_and_streamed(served, run, parser, text, content):
    whole, streamed, chunks = ask(served, run, text, parser)
    for choice in (whole.choices[0], streamed.choices[0]):
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == content and calls_of(choice.message) == CALLS
        assert all(c.type == "function" and c.id.startswith("call_") for c in choice.message.tool_calls)
    pieces = [p for chunk in chunks for choice in chunk.choices for p in choice.delta.tool_calls or ()]
    firsts = [p for p in pieces if p.id is not None]
    assert [(p.index, p.type, p.function.name, p.function.arguments) for p in firsts] == \
        [(0, "function", "get_weather", ""), (1, "function", "get_time", "")]
    assert len(pieces) > len(firsts) + 2  # the arguments came in fragments as the text grew
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content is None


@pytest.mark.parametrize("parser, text", [("hermes", LLAMA), ("llama3_json", HERMES),
                                          ("generic", "It is sunny in Paris."), ("generic", '{"city": "Paris"}')])
def test_text_the_parser_does_not_read_as_calls_is_content(served, run, parser, text):
    whole, streamed, _ = ask(served, run, text, parser)
    for choice in (whole.choices[0], streamed.choices[0]):
        assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (text, None, "stop")


def test_tool_choice_none_reads_no_calls_and_the_template_gets_the_tools(served, run):
    whole, streamed, _ = ask(served, run, HERMES, tool_choice="none")
    for choice in (whole.choices[0], streamed.choices[0]):
        assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (HERMES, None, "stop")
    engine, _ = served
    assert all(params.structured_outputs is None for _, params in engine.requests[-2:])


def test_calls_cut_by_max_tokens_finish_with_length(served, run):
    cut = LLAMA[:LLAMA.index('"city": "Pa') + 11]
    whole, streamed, _ = ask(served, run, cut, finish_reason="length")
    for choice in (whole.choices[0], streamed.choices[0]):
        assert choice.finish_reason == "length" and choice.message.content is None
        assert calls_of(choice.message) == [("get_weather", '{"city": "Pa')]


def test_each_of_n_choices_gets_its_own_calls(served, run):
    whole, streamed, _ = ask(served, run, HERMES, n=2)
    for completion in (whole, streamed):
        assert [calls_of(c.message) for c in completion.choices] == [CALLS, CALLS]
    ids = [c.id for choice in whole.choices for c in choice.message.tool_calls]
    assert len(set(ids)) == 4


def test_required_and_named_choices_reach_the_engine_as_constraints(served, run):
    whole, streamed, _ = ask(served, run, '[{"name": "get_time", "arguments": {}}]', tool_choice="required")
    for choice in (whole.choices[0], streamed.choices[0]):
        assert (calls_of(choice.message), choice.finish_reason) == ([("get_time", "{}")], "tool_calls")
    engine, _ = served
    assert engine.requests[-1][1].structured_outputs.json["items"]["anyOf"][1]["properties"]["name"] == \
        {"type": "string", "enum": ["get_time"]}
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole, streamed, _ = ask(served, run, ' {"city": "Oslo"}', tool_choice=named)
    for choice in (whole.choices[0], streamed.choices[0]):
        assert (calls_of(choice.message), choice.finish_reason) == ([("get_weather", '{"city": "Oslo"}')],
                                                                    "tool_calls")
    assert engine.requests[-1][1].structured_outputs.json == TOOLS[0]["function"]["parameters"]


def test_an_unknown_tool_call_parser_is_refused(model_dirs):
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        OpenAIServing(ScriptedEngine(), Tokenizer(model_dirs["llama"]), MODEL, 2048, tool_call_parser="mistral")


TOOL_TEMPLATE = (
    "{%- for t in tools or [] %}<tool {{ t.function.name }}>{%- endfor %}"
    "{%- for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}({{ c.function.name }}: {{ c.function.arguments.city }}){%- endfor %}"
    "{%- if m.tool_call_id %}[{{ m.tool_call_id }}]{%- endif %}{%- endfor %}<assistant>"
)


def test_the_chat_template_gets_the_tools_and_the_calls_of_the_conversation(model_dirs, run, tmp_path):
    """A template that writes the tools, the calls of assistant messages (their arguments decoded) and
    the ids tool messages answer: the prompt the engine gets holds them."""
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(Path(model_dirs["llama"]) / name, tmp_path / name)
    config = json.loads((Path(model_dirs["llama"]) / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOL_TEMPLATE}))
    tokenizer, engine = Tokenizer(str(tmp_path)), ScriptedEngine()
    engine.text = "ok"
    serving = OpenAIServing(engine, tokenizer, MODEL, 2048)
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_7", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "sunny"}]

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_openai_app(lambda: serving)),
                                     base_url="http://test") as http:
            chat = await http.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS})
            tokenized = await http.post("/tokenize", json={"messages": messages, "tools": TOOLS})
            return chat, tokenized

    response, tokenized = run(main())
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == "ok"
    prompt = engine.requests[-1][0]
    assert tokenizer.decode(prompt, skip_special_tokens=False) == (
        "<tool get_weather><tool get_time><user>Weather in Paris and the time?"
        "<assistant>(get_weather: Paris)<tool>sunny[call_7]<assistant>")
    assert tokenized.json()["tokens"] == prompt  # /tokenize renders the tools too
