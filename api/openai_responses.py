"""Response bodies of the OpenAI API: completions and chat completions (whole and streamed chunks),
usage, logprobs in each API's format, the model list, and vLLM's /tokenize and /detokenize answers.

Streamed chat deltas leave out the fields they do not carry (``{"content": "…"}``), and chunks carry
``usage`` only in the final usage chunk, as OpenAI sends them. A message carries ``tool_calls`` only
when calls were made (its ``content`` then null unless text came before them).
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from engine.messages import RequestOutput

_OMIT_NONE = {"exclude_if": lambda value: value is None}


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class UsageCounter:
    """Usage of one API request: each prompt's tokens once, completion tokens over all choices, and
    the prompt tokens the prefix cache served."""

    def __init__(self, prompts: list[list[int]]) -> None:
        self.prompt_tokens = sum(map(len, prompts))
        self.cached_tokens = [0] * len(prompts)
        self.completion_tokens = 0

    def add(self, prompt_index: int, output: RequestOutput) -> None:
        self.cached_tokens[prompt_index] = max(self.cached_tokens[prompt_index], output.num_cached_tokens)
        self.completion_tokens += sum(len(sample.token_ids) for sample in output.outputs)

    def info(self) -> UsageInfo:
        return UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                         total_tokens=self.prompt_tokens + self.completion_tokens,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.cached_tokens)))


# --- completions -----------------------------------------------------------------------------------


class CompletionLogprobs(BaseModel):
    """Per generated token: its text, logprob, the top tokens (plus the chosen one) and its offset
    in the choice's text."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(TypedDict):
    """vLLM's entry of a prompt token's ``prompt_logprobs`` dict (keyed by token id): a plain dict, as
    a response may hold max_prompt_logprobs_entries of them (api/openai_logprobs.prompt_logprobs)."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None  # with prompt_logprobs: first entry null, as vLLM
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or token id that ended the choice
    token_ids: list[int] | None = None  # the choice's generated token ids, with return_token_ids

    def extend(self, delta: CompletionChoice) -> None:
        """Append a later delta of the same choice."""
        self.text += delta.text
        if self.prompt_logprobs is None:
            self.prompt_logprobs = delta.prompt_logprobs
        if self.token_ids is not None and delta.token_ids is not None:
            self.token_ids.extend(delta.token_ids)
        if self.logprobs is not None and delta.logprobs is not None:
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(self.logprobs, name).extend(getattr(delta.logprobs, name))
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = Field(None, **_OMIT_NONE)


# --- chat completions ------------------------------------------------------------------------------


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCallResponse(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallResponse(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallResponse


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallResponse] | None = Field(None, **_OMIT_NONE)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def extend(self, delta: ChatStreamChoice) -> None:
        """Append a streamed delta of the same choice: its content, logprobs and tool-call pieces (a
        piece with an ``id`` opens a call, the others extend its arguments)."""
        self.message.content = (self.message.content or "") + (delta.delta.content or "")
        for piece in delta.delta.tool_calls or ():
            calls = self.message.tool_calls = self.message.tool_calls or []
            if piece.id is not None:
                calls.append(ToolCallResponse(id=piece.id, function=FunctionCallResponse(
                    name=piece.function.name or "", arguments="")))
            calls[piece.index].function.arguments += piece.function.arguments or ""
        if self.message.tool_calls and not self.message.content:
            self.message.content = None  # only calls were made
        if delta.logprobs is not None:
            self.logprobs = self.logprobs or ChatLogprobs(content=[])
            self.logprobs.content.extend(delta.logprobs.content or [])
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # with prompt_logprobs, as vLLM


class DeltaFunctionCall(BaseModel):
    name: str | None = Field(None, **_OMIT_NONE)
    arguments: str | None = Field(None, **_OMIT_NONE)


class DeltaToolCall(BaseModel):
    """A streamed piece of a call: the first has ``id``, ``type``, the name and ``arguments: ""``;
    later ones an argument fragment (as OpenAI streams them)."""

    index: int
    id: str | None = Field(None, **_OMIT_NONE)
    type: Literal["function"] | None = Field(None, **_OMIT_NONE)
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = Field(None, **_OMIT_NONE)
    content: str | None = Field(None, **_OMIT_NONE)
    tool_calls: list[DeltaToolCall] | None = Field(None, **_OMIT_NONE)


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = Field(None, **_OMIT_NONE)


# --- models, tokenizer -----------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "kvserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str
