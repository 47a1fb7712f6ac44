"""Request bodies of the OpenAI API's completions, the sampling fields every request shares (with
vLLM's extra ones), the error body, and the mapping to ``SamplingParams``; the chat and tokenize bodies
build on them in ``api.openai_chat_protocol``.

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


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo
