"""Request bodies of the OpenAI API (completions, chat completions) plus vLLM's extra sampling fields,
vLLM's /tokenize and /detokenize bodies, the error body, and the mapping to ``SamplingParams``.

Unknown fields are ignored, as OpenAI does. Features the engine lacks are refused by validation
(HTTP 400 naming the field): ``logit_bias``, ``suffix``, ``best_of`` other than ``n``, ``echo`` with
``logprobs`` (``prompt_logprobs`` gives those), ``priority`` other than 0, ``prompt_logprobs`` with
``stream`` (as vLLM). ``truncate_prompt_tokens`` keeps a prompt's last k tokens (-1: max_model_len).
Output constraints (``response_format``, vLLM's ``structured_outputs`` and ``guided_*``, a
``required`` or named ``tool_choice``) become ``SamplingParams.structured_outputs``
(``api.structured``); more than one at once is a 400 naming them. Every numeric field
is checked against the ranges of ``api.limits`` (integers that fit the engine's types, finite floats
in the sampler's ranges), every text field for lone surrogates (UTF-8 cannot carry them), and prompt
token ids for the int32 range; the engine checks the rest (its caps, the vocabulary, the length), and
its ValueError becomes a 400 with its message.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError,
                      ValidatorFunctionWrapHandler, field_validator, model_validator)
from pydantic_core import PydanticCustomError

from api import structured
from api.limits import FLOAT_RANGES, INT_RANGES, TEXT_ERROR, valid_text
from engine.sampling_params import SamplingParams, StructuredOutputsParams, format_bound


def _checked_text(value: str) -> str:
    if not valid_text(value):
        raise PydanticCustomError("invalid_text", TEXT_ERROR)
    return value


def _int_range(name: str) -> Any:
    low, high = INT_RANGES[name]
    return Field(ge=low, le=high)


def _float_range(name: str) -> Any:
    low, high, low_open = FLOAT_RANGES[name]
    return Field(gt=low, le=high, allow_inf_nan=False) if low_open else Field(ge=low, le=high, allow_inf_nan=False)


Text = Annotated[str, AfterValidator(_checked_text)]  # a str that UTF-8 can encode
Int = {name: Annotated[int, _int_range(name)] for name in INT_RANGES}
def _float_type(name: str) -> Any:
    """A float field of ``FLOAT_RANGES``; a lowest bound that pydantic would print as a long decimal
    (the smallest normal float32 of ``top_p``) is checked here, its message naming it as typed."""
    low, high, low_open = FLOAT_RANGES[name]
    if low_open or format_bound(low) == f"{low:g}":
        return Annotated[float, _float_range(name)]

    def at_least(value: float) -> float:
        if value < low:
            raise PydanticCustomError("greater_than_equal", f"Input should be greater than or equal to "
                                                            f"{format_bound(low)}")
        return value

    return Annotated[float, Field(le=high, allow_inf_nan=False), AfterValidator(at_least)]


Float = {name: _float_type(name) for name in FLOAT_RANGES}


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _unsupported(what: str) -> PydanticCustomError:
    return PydanticCustomError("not_supported", "{what} is not supported", {"what": what})


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


def _value_error(exc: ValueError) -> PydanticCustomError:
    return PydanticCustomError("invalid_value", "{reason}", {"reason": str(exc)})


class JsonSchemaFormat(OpenAIBaseModel):
    """``response_format.json_schema``: the schema under ``schema``; ``strict`` is always honoured
    (the output is constrained to the schema either way)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: Text = "response"
    description: Text | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise PydanticCustomError("missing_schema", 'a response_format of type "json_schema" needs '
                                                        'json_schema.schema (the JSON schema)')
        return self

    def constraint(self) -> StructuredOutputsParams | None:
        schema = self.json_schema.json_schema if self.json_schema is not None else None
        return structured.from_response_format(self.type, schema)


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, or its text), ``json_object``,
    ``regex``, ``choice`` and ``grammar`` (EBNF)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    json_schema: dict[str, Any] | Text | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputsRequest:
        try:
            self.constraint()
        except ValueError as exc:
            raise _value_error(exc) from None
        return self

    def constraint(self) -> StructuredOutputsParams:
        return structured.from_fields(json=self.json_schema, regex=self.regex, choice=self.choice,
                                      grammar=self.grammar, json_object=self.json_object)


class _SamplingRequest(OpenAIBaseModel):
    """The fields both APIs share: OpenAI's sampling fields and vLLM's extras."""

    model: Text | None = None  # None: the served model
    n: Int["n"] = 1
    temperature: Float["temperature"] | None = None
    top_p: Float["top_p"] | None = None
    stop: str | list[str] | None = None
    seed: Int["seed"] | None = None
    presence_penalty: Float["presence_penalty"] | None = None
    frequency_penalty: Float["frequency_penalty"] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: Int["top_k"] | None = None
    min_p: Float["min_p"] | None = None
    repetition_penalty: Float["repetition_penalty"] | None = None
    min_tokens: Int["min_tokens"] = 0
    ignore_eos: bool = False
    stop_token_ids: list[Int["stop_token_ids"]] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: Text | None = None
    prompt_logprobs: Int["prompt_logprobs"] | None = None  # per prompt token: its logprob, rank and the top k
    truncate_prompt_tokens: Int["truncate_prompt_tokens"] | None = None  # keep the last k (-1: max_model_len)
    priority: int = 0  # no priority scheduling: only the default is accepted
    # output constraints: OpenAI's response_format; vLLM's structured_outputs and its older guided_* names
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = Field(None, min_length=1)
    guided_grammar: Text | None = None

    @field_validator("stop")
    @classmethod
    def _stop_text(cls, value: str | list[str] | None) -> str | list[str] | None:
        for text in [value] if isinstance(value, str) else value or ():
            _checked_text(text)
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation(cls, value: int | None) -> int | None:
        if value == 0:
            raise PydanticCustomError("invalid_value", "truncate_prompt_tokens must be -1 (keep max_model_len "
                                                       "tokens) or at least 1, got 0")
        return value

    @model_validator(mode="after")
    def _prompt_logprobs_unstreamed(self) -> _SamplingRequest:
        if self.prompt_logprobs is not None and self.stream:
            raise PydanticCustomError("not_supported", "prompt_logprobs are not available when stream is true")
        return self

    @field_validator("priority")
    @classmethod
    def _no_priority(cls, value: int) -> int:
        if value != 0:
            raise PydanticCustomError("not_supported", "priority other than 0 is not supported (requests are "
                                                       "served first come, first served), got {value}",
                                      {"value": value})
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict | None) -> None:
        if value:
            raise _unsupported("logit_bias")
        return None

    @model_validator(mode="after")
    def _one_output_constraint(self) -> _SamplingRequest:
        try:
            self.output_constraint()
        except ValueError as exc:
            raise _value_error(exc) from None
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _constraints(self) -> dict[str, StructuredOutputsParams | None]:
        """Each constraining field's constraint (None where the field sets none)."""
        return {
            "response_format": self.response_format.constraint() if self.response_format else None,
            "structured_outputs": self.structured_outputs.constraint() if self.structured_outputs else None,
            "guided_json": None if self.guided_json is None else StructuredOutputsParams(json=self.guided_json),
            "guided_regex": None if self.guided_regex is None else StructuredOutputsParams(regex=self.guided_regex),
            "guided_choice": None if self.guided_choice is None else StructuredOutputsParams(
                choice=tuple(self.guided_choice)),
            "guided_grammar": None if self.guided_grammar is None else StructuredOutputsParams(
                grammar=self.guided_grammar),
        }

    def output_constraint(self) -> StructuredOutputsParams | None:
        """The request's one output constraint, or None; ValueError naming the fields that set more."""
        return structured.constraint_of(self._constraints())

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError (from SamplingParams) for values out of range."""
        def default(value: Any, fallback: Any) -> Any:
            return fallback if value is None else value

        return SamplingParams(
            n=self.n, temperature=default(self.temperature, 1.0), top_p=default(self.top_p, 1.0),
            top_k=default(self.top_k, 0), min_p=default(self.min_p, 0.0), seed=self.seed,
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, logprobs=logprobs, prompt_logprobs=self.prompt_logprobs,
            presence_penalty=default(self.presence_penalty, 0.0),
            frequency_penalty=default(self.frequency_penalty, 0.0),
            repetition_penalty=default(self.repetition_penalty, 1.0),
            structured_outputs=self.output_constraint(),
        )


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. Each prompt (text or token ids) is one engine request of ``n`` samples.
    ``echo`` is supported without ``logprobs``: the prompt's text leads each choice's text."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Int["max_tokens"] | None = 16
    logprobs: Int["logprobs"] | None = None
    echo: bool = False
    best_of: Int["best_of"] | None = None
    return_token_ids: bool = False  # vLLM extra: each choice (and stream chunk) carries its token ids
    suffix: str | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_forms(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            prompt = handler(value)
        except ValidationError:  # one message instead of one per member of the union
            raise PydanticCustomError("prompt_type", "prompt must be a string, a list of strings, a list "
                                                     "of token ids or a list of lists of token ids") from None
        if (isinstance(prompt, list) and not prompt) or any(isinstance(item, list) and not item for item in prompt):
            raise PydanticCustomError("empty_prompt", "prompt must not be empty (nor hold an empty list of token ids)")
        low, high = INT_RANGES["token_ids"]
        for item in [prompt] if isinstance(prompt, str) else prompt:
            if isinstance(item, str):
                if not valid_text(item):
                    raise PydanticCustomError("invalid_text", TEXT_ERROR)
                continue
            for token_id in [item] if isinstance(item, int) else item:
                if not low <= token_id <= high:
                    raise PydanticCustomError(
                        "token_id_range", "token ids must be integers in [{low}, {high}], got {token_id}",
                        {"low": low, "high": high, "token_id": token_id})
        return prompt

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> None:
        if value:
            raise _unsupported("suffix")
        return None

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info) -> int | None:
        if value is not None and value != info.data.get("n", 1):
            raise PydanticCustomError("not_supported", "best_of other than n is not supported")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo_logprobs(cls, value: bool, info) -> bool:
        if value and info.data.get("logprobs") is not None:
            raise PydanticCustomError("not_supported", "echo with logprobs is not supported (prompt_logprobs "
                                                       "gives the prompt's logprobs)")
        return value

    def to_sampling_params(self) -> SamplingParams:
        return self._sampling_params(self.max_tokens, self.logprobs)


class ContentPart(OpenAIBaseModel):
    type: Text
    text: Text = ""


_TOOL_NAME_ERROR = "a function name is 1 to 64 letters, digits, underscores, dashes or dots"


def _checked_tool_name(value: str) -> str:
    if not 1 <= len(value) <= 64 or not all(c.isascii() and (c.isalnum() or c in "_-.") for c in value):
        raise PydanticCustomError("invalid_name", _TOOL_NAME_ERROR + ", got {name}", {"name": repr(value[:80])})
    return value


ToolName = Annotated[str, AfterValidator(_checked_tool_name)]


class FunctionDefinition(OpenAIBaseModel):
    name: ToolName
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; None: no arguments
    strict: bool | None = None  # calls constrained by tool_choice follow the schema either way


class ChatTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(OpenAIBaseModel):
    name: Text


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class FunctionCall(OpenAIBaseModel):
    name: Text
    arguments: Text = "{}"  # the arguments as a JSON text


class ToolCall(OpenAIBaseModel):
    """A call an earlier assistant message made (in the conversation sent back)."""

    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict[str, Any]:
        """As chat templates read it: ``arguments`` decoded when they are a JSON object (templates
        write them with ``tojson``), else the text as it is."""
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            arguments = None
        call = {"type": "function", "function": {
            "name": self.function.name,
            "arguments": arguments if isinstance(arguments, dict) else self.function.arguments}}
        if self.id is not None:
            call["id"] = self.id
        return call


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant message's calls
    tool_call_id: Text | None = None  # a tool message: the call it answers

    @field_validator("content")
    @classmethod
    def _text_only(cls, value: str | list[ContentPart] | None) -> str | list[ContentPart] | None:
        if isinstance(value, str):
            _checked_text(value)
        for part in value if isinstance(value, list) else ():
            if part.type != "text":
                raise _unsupported(f"content of type {part.type!r}")
        return value

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template reads it; text parts are joined by newlines."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


_TEMPLATE_OWN_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")


def _checked_template_kwargs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM's ``chat_template_kwargs``: further variables for the chat template (e.g. ``enable_thinking``),
    never one the request sets through its own fields, every string valid text."""
    for name in _TEMPLATE_OWN_VARIABLES:
        if value and name in value:
            raise PydanticCustomError("reserved_name", "chat_template_kwargs must not set {name}, "
                                      "which the request sets through its own fields", {"name": name})
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            _checked_text(item)
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return value


TemplateKwargs = Annotated[dict[str, Any] | None, AfterValidator(_checked_template_kwargs)]


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions. The conversation is rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int["max_tokens"] | None = None
    max_completion_tokens: Int["max_completion_tokens"] | None = None  # wins over the deprecated max_tokens
    logprobs: bool = False
    top_logprobs: Int["top_logprobs"] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True  # vLLM extra
    chat_template_kwargs: TemplateKwargs = None  # vLLM extra: further chat template variables

    @field_validator("tools")
    @classmethod
    def _distinct_tools(cls, value: list[ChatTool] | None) -> list[ChatTool] | None:
        names = [tool.function.name for tool in value or ()]
        if duplicate := next((name for name in names if names.count(name) > 1), None):
            raise PydanticCustomError("duplicate_tool", "two tools are named {name}", {"name": repr(duplicate)})
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_needs_tools(cls, value: str | NamedToolChoice | None, info) -> str | NamedToolChoice | None:
        tools = info.data.get("tools")
        if value is None:
            return value
        if not tools:
            raise PydanticCustomError("tools_missing", "tool_choice is only allowed when tools are given")
        if isinstance(value, NamedToolChoice):
            names = [tool.function.name for tool in tools]
            if value.function.name not in names:
                raise PydanticCustomError(
                    "unknown_tool", "tool_choice names the function {name}, which is not among the tools "
                    "({names})", {"name": repr(value.function.name), "names": ", ".join(names)})
        return value

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("invalid_value", "top_logprobs requires logprobs to be true")
        return self

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """"none" without tools; "auto" when tools are given without a choice."""
        if not self.tools:
            return "none"
        return "auto" if self.tool_choice is None else self.tool_choice

    def tools_for_template(self) -> list[dict[str, Any]] | None:
        return None if not self.tools else [tool.model_dump(exclude_none=True) for tool in self.tools]

    def _constraints(self) -> dict[str, StructuredOutputsParams | None]:
        """The fields' constraints, and that of a required or named ``tool_choice``."""
        constraints = super()._constraints()
        choice = self.effective_tool_choice
        functions = [tool.function.model_dump(exclude_none=True) for tool in self.tools or ()]
        if choice == "required":
            schema = structured.required_calls_schema(functions, self.parallel_tool_calls)
            constraints["tool_choice"] = StructuredOutputsParams(json=structured.transportable(schema))
        elif isinstance(choice, NamedToolChoice):
            function = next(f for f in functions if f["name"] == choice.function.name)
            constraints["tool_choice"] = StructuredOutputsParams(
                json=structured.transportable(structured.tool_parameters(function)))
        return constraints

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


class TokenizeRequest(OpenAIBaseModel):
    """POST /tokenize: a ``prompt``, or ``messages`` rendered with the chat template. Special tokens
    are added by default to a prompt, not to messages (the template writes its own)."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None  # with messages: the tools the chat template renders
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: TemplateKwargs = None

    def tools_for_template(self) -> list[dict[str, Any]] | None:
        return None if not self.tools else [tool.model_dump(exclude_none=True) for tool in self.tools]

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("invalid_value", "give exactly one of prompt and messages")
        return self


class DetokenizeRequest(OpenAIBaseModel):
    model: Text | None = None
    tokens: list[int]


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo
