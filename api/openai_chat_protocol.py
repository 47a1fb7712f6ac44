"""Request bodies of the OpenAI chat API (messages, tools, tool choices, chat template arguments) and
vLLM's /tokenize and /detokenize bodies (a tokenize body may carry messages). The sampling fields,
their ranges and the mapping to ``SamplingParams`` are the completions' (``api.openai_protocol``)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from api import structured
from api.openai_protocol import Int, OpenAIBaseModel, Text, _checked_text, _SamplingRequest, _unsupported
from engine.sampling_params import SamplingParams, StructuredOutputsParams


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
