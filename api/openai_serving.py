"""The OpenAI API over any ``EngineClient``: no Ray, no FastAPI.

    request ─► check model, tokenize, SamplingParams, length ─► EngineStreams (one engine request
    per prompt, n samples each) ─► wait for the first output (admission errors keep their status)
    ─► a response dict, or an ``EventStream`` of SSE strings

Tools: the request's tools reach the chat template. A ``required`` or named ``tool_choice`` constrains
the output (``api.openai_protocol``), whose calls are then read by ``RequiredCallsParser`` /
``NamedCallParser``; ``auto`` reads calls out of free text with the server's ``tool_call_parser``
(``api.tool_parsers``). Calls become ``message.tool_calls`` (streamed: ``delta.tool_calls`` pieces)
and a choice that made calls and stopped finishes with ``tool_calls``.

Choice ``i`` of prompt ``p`` has index ``p * n + i``. Usage counts each prompt once, completion tokens
over all choices, and the prompt tokens the prefix cache served. Once a stream has started, an error
becomes an error event followed by ``[DONE]``; a stream left early aborts its engine requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar

import jinja2
from pydantic import BaseModel

from api.engine_client import AsyncLLMClient, EngineClient, EngineStreams
from api.errors import OpenAIError
from api.limits import DEFAULT_MAX_PROMPTS_PER_REQUEST, check_prompt_count
from api.openai_logprobs import TokenTexts, chat_logprobs, completion_logprobs, prompt_logprobs
from api.openai_chat_protocol import ChatCompletionRequest, DetokenizeRequest, NamedToolChoice, TokenizeRequest
from api.openai_protocol import CompletionRequest
from api.openai_responses import (ChatChoice, ChatCompletionResponse, ChatCompletionStreamResponse,
                                  ChatResponseMessage, ChatStreamChoice, CompletionChoice,
                                  CompletionResponse, CompletionStreamResponse, DeltaFunctionCall,
                                  DeltaMessage, DeltaToolCall, DetokenizeResponse, ModelCard, ModelList,
                                  TokenizeResponse, UsageCounter)
from api.tool_parsers import (DEFAULT_TOOL_PARSER, TOOL_PARSERS, NamedCallParser, RequiredCallsParser,
                              ToolCallExtractor, ToolParser, check_tool_parser)
from engine.messages import CompletionOutput, RequestOutput, merge_outputs
from engine.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams
from engine.tokenizer import Tokenizer

__all__ = ["AsyncLLMClient", "EngineClient", "EventStream", "OpenAIError", "OpenAIServing"]

T = TypeVar("T")


def _openai_errors(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Whatever the method raises reaches the caller as an OpenAIError."""
    @functools.wraps(method)
    async def wrapper(*args, **kwargs) -> T:
        try:
            return await method(*args, **kwargs)
        except Exception as exc:
            raise OpenAIError.from_exception(exc) from exc
    return wrapper


class EventStream:
    """The server-sent events of one streamed response, ``data: {json}\\n\\n`` … ``data: [DONE]\\n\\n``.
    Leaving the iteration early or ``aclose()`` (even before the first event) aborts the engine
    requests that are still running."""

    def __init__(self, events: AsyncGenerator[str, None], streams: EngineStreams) -> None:
        self._events, self._streams = events, streams

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> str:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        self._streams.close()
        await self._events.aclose()


class OpenAIServing:
    """Completions, chat completions, models and vLLM's tokenize/detokenize for one served model.
    Every method raises ``OpenAIError`` (status, OpenAI error body) for whatever goes wrong.
    ``tool_call_parser`` names the format calls are read in under ``tool_choice: "auto"``
    (``api.tool_parsers.TOOL_PARSERS``)."""

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, served_model_name: str,
                 max_model_len: int, stream_interval: int = 1,
                 tool_call_parser: str = DEFAULT_TOOL_PARSER,
                 max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
                 max_logprobs: int = MAX_LOGPROBS) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.tool_call_parser = check_tool_parser(tool_call_parser)
        self.engine = engine
        self.stream_interval = stream_interval
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.max_prompts_per_request = max_prompts_per_request
        self.max_logprobs = max_logprobs  # the engine's: the cap of every logprobs field
        self.token_texts = TokenTexts(tokenizer)
        self._tasks: set[asyncio.Task] = set()  # engine streams in flight

    # --- endpoints -------------------------------------------------------------------------------

    @_openai_errors
    async def completions(self, req: CompletionRequest) -> dict | EventStream:
        self._check_model(req.model)
        self._check_logprobs(req, "logprobs", "prompt_logprobs")
        texts, prompts = self._completion_prompts(req.prompt, req.truncate_prompt_tokens)
        params = req.to_sampling_params()
        for prompt in prompts:
            self._check_length(len(prompt), params.max_tokens, "prompt")
        echo = [t if t is not None else self.tokenizer.decode(p) for t, p in zip(texts, prompts)] \
            if req.echo else None
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self._start(request_id, prompts, params, req.cache_salt)
        usage = UsageCounter(prompts)
        choices = self._completion_choices(streams, params, usage, echo, req.return_token_ids)
        if req.stream:
            return self._event_stream(self._completion_chunks(request_id, choices, usage, req.include_usage), streams)
        merged: dict[int, CompletionChoice] = {}
        with contextlib.closing(streams):
            async for choice in choices:
                if choice.index in merged:
                    merged[choice.index].extend(choice)
                else:
                    merged[choice.index] = choice
        return CompletionResponse(id=request_id, model=self.served_model_name, usage=usage.info(),
                                  choices=[merged[i] for i in sorted(merged)]).model_dump(mode="json")

    @_openai_errors
    async def chat_completions(self, req: ChatCompletionRequest) -> dict | EventStream:
        self._check_model(req.model)
        self._check_logprobs(req, "top_logprobs", "prompt_logprobs")
        prompt = self._chat_prompt([m.for_template() for m in req.messages], req.add_generation_prompt,
                                   req.chat_template_kwargs, req.tools_for_template())
        prompt = self._truncated(prompt, req.truncate_prompt_tokens)
        params = req.to_sampling_params()
        self._check_length(len(prompt), params.max_tokens, "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self._start(request_id, [prompt], params, req.cache_salt)
        usage = UsageCounter([prompt])
        tool_parser = self._tool_parser(req)
        prompt_lps: dict[int, list] = {}  # with prompt_logprobs: the engine's, once they came
        choices = self._chat_choices(streams, params, usage, tool_parser, prompt_lps)
        if req.stream:
            # with tools the opening delta carries no content: a message of calls only has none
            chunks = self._chat_chunks(request_id, params.n, choices, usage, req.include_usage,
                                       opening_content=None if tool_parser else "")
            return self._event_stream(chunks, streams)
        merged: dict[int, ChatChoice] = {}
        with contextlib.closing(streams):
            async for delta in choices:
                merged.setdefault(delta.index, ChatChoice(index=delta.index, message=ChatResponseMessage(content="")))
                merged[delta.index].extend(delta)
        return ChatCompletionResponse(id=request_id, model=self.served_model_name, usage=usage.info(),
                                      choices=[merged[i] for i in sorted(merged)],
                                      prompt_logprobs=(prompt_logprobs(self.token_texts, prompt_lps[0])
                                                       if 0 in prompt_lps else None)).model_dump(mode="json")

    async def models(self) -> dict:
        return ModelList(data=[self._model_card()]).model_dump(mode="json")

    async def model(self, model_id: str) -> dict:
        """/v1/models/{id}: the served model's card; any other id is a 404."""
        self._check_model(model_id)
        return self._model_card().model_dump(mode="json")

    def _model_card(self) -> ModelCard:
        return ModelCard(id=self.served_model_name, root=self.served_model_name, max_model_len=self.max_model_len)

    @_openai_errors
    async def tokenize(self, req: TokenizeRequest) -> dict:
        """vLLM's /tokenize: special tokens are added to a prompt by default, not to messages."""
        self._check_model(req.model)
        if req.messages is not None:
            text = self._render_chat([m.for_template() for m in req.messages], req.add_generation_prompt,
                                     req.chat_template_kwargs, req.tools_for_template())
            tokens = self.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
        else:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            tokens = self.tokenizer.encode(req.prompt, add_special_tokens=add_special)
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=self.max_model_len).model_dump()

    @_openai_errors
    async def detokenize(self, req: DetokenizeRequest) -> dict:
        self._check_model(req.model)
        vocab_size = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab_size for t in req.tokens):
            raise OpenAIError.bad_request(f"token ids must be in [0, {vocab_size})", "tokens")
        prompt = self.tokenizer.decode(req.tokens, skip_special_tokens=False)
        return DetokenizeResponse(prompt=prompt).model_dump()

    # --- input -----------------------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model",
                              "model_not_found")

    def _check_logprobs(self, req, *names: str) -> None:
        """The engine's max_logprobs caps these fields (named in the 400; the engine checks it again)."""
        for name in names:
            value = getattr(req, name)
            if value is not None and value > self.max_logprobs:
                raise OpenAIError.bad_request(f"{name} must be at most {self.max_logprobs} (the server's "
                                              f"max_logprobs), got {value}", name)

    def _completion_prompts(self, prompt: str | list, truncate: int | None = None
                            ) -> tuple[list[str | None], list[list[int]]]:
        """(text or None, token ids) per prompt of a completion request, each cut to its last
        ``truncate`` tokens (a cut prompt's text is None: it is decoded from the ids kept)."""
        items = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
        if not items:
            raise OpenAIError.bad_request("prompt must not be empty", "prompt")
        try:
            check_prompt_count(len(items), self.max_prompts_per_request)
        except ValueError as exc:
            raise OpenAIError.bad_request(str(exc), "prompt") from None
        texts = [p if isinstance(p, str) else None for p in items]
        prompts = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in items]
        cut = [self._truncated(p, truncate) for p in prompts]
        return [t if len(c) == len(p) else None for t, c, p in zip(texts, cut, prompts)], cut

    def _truncated(self, prompt: list[int], truncate: int | None) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the prompt's last k tokens (-1: max_model_len of them)."""
        if truncate is None:
            return prompt
        if truncate > self.max_model_len:
            raise OpenAIError.bad_request(f"truncate_prompt_tokens must be at most max_model_len "
                                          f"({self.max_model_len}), got {truncate}", "truncate_prompt_tokens")
        keep = self.max_model_len if truncate == -1 else truncate
        return prompt[-keep:]

    def _render_chat(self, messages: list[dict], add_generation_prompt: bool,
                     chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tools=tools, chat_template_kwargs=chat_template_kwargs)
        except (ValueError, jinja2.TemplateError) as exc:  # the template's raise_exception: a ValueError
            raise OpenAIError.bad_request(f"the chat template refused the messages: {exc}", "messages") from exc

    def _chat_prompt(self, messages: list[dict], add_generation_prompt: bool,
                     chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[int]:
        text = self._render_chat(messages, add_generation_prompt, chat_template_kwargs, tools)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _tool_parser(self, req: ChatCompletionRequest) -> ToolParser | None:
        """How calls are read out of the request's output; None: the output is all content."""
        choice = req.effective_tool_choice
        if choice == "none":
            return None
        if choice == "required":
            return RequiredCallsParser()
        if isinstance(choice, NamedToolChoice):
            return NamedCallParser(choice.function.name)
        return TOOL_PARSERS[self.tool_call_parser]()

    def _check_length(self, num_prompt_tokens: int, max_tokens: int | None, param: str) -> None:
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise OpenAIError.bad_request(
                f"This model's maximum context length is {limit} tokens, and the {param} has "
                f"{num_prompt_tokens}: no room is left for the completion.", param)
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise OpenAIError.bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {param}, "
                f"{max_tokens} for the completion). Reduce the {param} or max_tokens.", "max_tokens")

    async def _start(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                     cache_salt: str | None) -> EngineStreams:
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        streams = EngineStreams(self.engine, ids, prompts, params, cache_salt, self._tasks)
        try:
            await streams.wait_started()
        except BaseException:
            streams.close()
            raise
        return streams

    # --- output ----------------------------------------------------------------------------------

    async def _samples(self, streams: EngineStreams, n: int, usage: UsageCounter, prompt_lps: dict | None = None
                       ) -> AsyncIterator[tuple[int, CompletionOutput]]:
        """Each engine delta's samples; with ``stream_interval`` > 1 a prompt's deltas are held and
        merged until one of its samples has that many new tokens or the request finishes. A prompt's
        prompt logprobs go to ``prompt_lps[prompt index]`` when they come."""
        held: dict[int, RequestOutput] = {}
        async for prompt_index, output in streams:
            usage.add(prompt_index, output)
            if prompt_lps is not None and output.prompt_logprobs is not None:
                prompt_lps[prompt_index] = output.prompt_logprobs
            if self.stream_interval > 1:
                if prompt_index in held:
                    output = merge_outputs(held.pop(prompt_index), output, RequestOutputKind.DELTA)
                if not output.finished and max(len(s.token_ids) for s in output.outputs) < self.stream_interval:
                    held[prompt_index] = output
                    continue
            for sample in output.outputs:
                yield prompt_index * n + sample.index, sample

    async def _completion_choices(self, streams: EngineStreams, params: SamplingParams, usage: UsageCounter,
                                  echo: list[str] | None, token_ids: bool = False
                                  ) -> AsyncIterator[CompletionChoice]:
        """One delta choice per engine delta per sample: echoed prompt first, logprobs with offsets."""
        offsets: dict[int, int] = {}  # choice index -> characters so far, once the choice started
        prompt_lps: dict[int, list] = {}  # prompt index -> the engine's prompt logprobs, once they came
        rendered: dict[int, list] = {}
        with_prompt_lps: set[int] = set()
        async for index, sample in self._samples(streams, params.n, usage, prompt_lps):
            text = sample.text
            if echo is not None and index not in offsets:
                text = echo[index // params.n] + text
            logprobs, offsets[index] = None, offsets.get(index, 0)
            if params.logprobs is not None:
                logprobs, offsets[index] = completion_logprobs(self.token_texts, sample, offsets[index])
            prompt_entries = None  # each choice carries its prompt's prompt logprobs once (its first delta)
            if index not in with_prompt_lps and index // params.n in prompt_lps:
                with_prompt_lps.add(index)
                if index // params.n not in rendered:
                    rendered[index // params.n] = prompt_logprobs(self.token_texts, prompt_lps[index // params.n])
                prompt_entries = rendered[index // params.n]
            yield CompletionChoice(index=index, text=text, logprobs=logprobs, prompt_logprobs=prompt_entries,
                                   finish_reason=sample.finish_reason, stop_reason=sample.stop_reason,
                                   token_ids=list(sample.token_ids) if token_ids else None)

    async def _chat_choices(self, streams: EngineStreams, params: SamplingParams, usage: UsageCounter,
                            tool_parser: ToolParser | None = None, prompt_lps: dict | None = None
                            ) -> AsyncIterator[ChatStreamChoice]:
        """One delta choice per engine delta per sample. With a tool parser each sample's text so far
        is scanned for calls: the delta carries the new content and call pieces, and a sample that
        made calls and stopped finishes with ``tool_calls``."""
        extractors: dict[int, ToolCallExtractor] = {}
        texts: dict[int, str] = {}  # each sample's text so far
        async for index, sample in self._samples(streams, params.n, usage, prompt_lps):
            logprobs = None
            if params.logprobs is not None:
                logprobs = chat_logprobs(self.token_texts, sample, params.logprobs)
            finish_reason = sample.finish_reason
            if tool_parser is None:
                delta = DeltaMessage(content=sample.text)
            else:
                extractor = extractors.setdefault(index, ToolCallExtractor(tool_parser))
                texts[index] = texts.get(index, "") + sample.text
                content, pieces = extractor.update(texts[index], finish_reason is not None)
                delta = DeltaMessage(content=content or None, tool_calls=[DeltaToolCall(
                    index=p.index, id=p.id, type=None if p.id is None else "function",
                    function=DeltaFunctionCall(name=p.name, arguments=p.arguments)) for p in pieces] or None)
                if finish_reason == "stop" and extractor.calls:
                    finish_reason = "tool_calls"
            yield ChatStreamChoice(index=index, delta=delta, logprobs=logprobs,
                                   finish_reason=finish_reason, stop_reason=sample.stop_reason)

    async def _completion_chunks(self, request_id: str, choices: AsyncIterator[CompletionChoice],
                                 usage: UsageCounter, include_usage: bool) -> AsyncIterator[BaseModel]:
        name = self.served_model_name
        async for choice in choices:
            if choice.text or choice.finish_reason or choice.logprobs or choice.token_ids:
                yield CompletionStreamResponse(id=request_id, model=name, choices=[choice])
        if include_usage:
            yield CompletionStreamResponse(id=request_id, model=name, choices=[], usage=usage.info())

    async def _chat_chunks(self, request_id: str, n: int, choices: AsyncIterator[ChatStreamChoice],
                           usage: UsageCounter, include_usage: bool, opening_content: str | None = ""
                           ) -> AsyncIterator[BaseModel]:
        name = self.served_model_name
        for index in range(n):  # every choice opens with the role
            start = ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=opening_content))
            yield ChatCompletionStreamResponse(id=request_id, model=name, choices=[start])
        async for choice in choices:
            if choice.delta.content or choice.delta.tool_calls or choice.finish_reason or choice.logprobs:
                yield ChatCompletionStreamResponse(id=request_id, model=name, choices=[choice])
        if include_usage:
            yield ChatCompletionStreamResponse(id=request_id, model=name, choices=[], usage=usage.info())

    def _event_stream(self, events: AsyncIterator[BaseModel], streams: EngineStreams) -> EventStream:
        async def sse() -> AsyncGenerator[str, None]:
            try:
                try:
                    async for event in events:
                        yield f"data: {event.model_dump_json()}\n\n"
                except Exception as exc:
                    yield f"data: {json.dumps(OpenAIError.from_exception(exc).body())}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                streams.close()
        return EventStream(sse(), streams)
