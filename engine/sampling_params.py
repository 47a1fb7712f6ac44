"""Sampling parameters of one request, validated on construction."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from enum import Enum

MAX_LOGPROBS = 20  # the default of the engine's max_logprobs
_GREEDY_TEMPERATURE = 1e-5
# what the workers hold these values in: int32 counts and token ids, an int64 seed, float32 numbers
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
# the smallest normal float32: top_p and repetition_penalty reach the workers as float32, where a
# smaller value becomes a subnormal or 0 (top_p 0 masks every token; a penalty of 0 divides by zero)
FLOAT32_MIN_NORMAL = 1.1754943508222875e-38


def format_bound(value: float) -> str:
    """A range bound as a client can type it back: short where that is exact, else in full."""
    short = f"{value:g}"
    return short if float(short) == value else repr(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_list(values) -> list[int]:
    if isinstance(values, (str, bytes)) or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                                    for t in (values or [])):
        raise ValueError(f"stop_token_ids must be a list of integers, got {values!r}")
    return [int(t) for t in (values or [])]


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on what a request may generate: exactly one of the fields is set.

    ``json``: a JSON schema (a dict, or its text); ``json_object``: any JSON object; ``regex``: a
    regular expression the whole output matches; ``choice``: the output is one of these strings;
    ``grammar``: an EBNF grammar (GBNF dialect, rule ``root``). A constrained request finishes with
    ``stop`` when its constraint admits no further token. The engine compiles the constraint off the
    step loop; a constraint that does not compile fails its request alone with a ValueError.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured output choice must be a list of strings")
            if not self.choice:
                raise ValueError("structured output choice must hold at least one string")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured output json must be a JSON schema (an object or its text), "
                             f"got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured output {name} must be a string, got {type(value).__name__}")
        if not isinstance(self.json_object, bool):
            raise ValueError("structured output json_object must be true or false")
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("structured outputs take exactly one of json, json_object, regex, choice and "
                             f"grammar, got {', '.join(given) or 'none'}")

    @property
    def kind(self) -> str:
        """Which constraint: "json", "json_object", "regex", "choice" or "grammar"."""
        if self.json_object:
            return "json_object"
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)


class RequestOutputKind(Enum):
    CUMULATIVE = "cumulative"  # every output carries everything generated so far
    DELTA = "delta"  # every output carries only what is new since the last one (streaming)
    FINAL_ONLY = "final_only"  # one output, when the request finishes


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Defaults follow the OpenAI / vLLM conventions.

    ``temperature == 0`` is greedy. ``top_k`` 0 or -1 and ``top_p == 1`` disable those filters. ``seed``
    makes a request's samples independent of whatever else shares its batch. ``logprobs = k`` returns,
    per generated token, the log-probabilities of the k most likely tokens plus the chosen one;
    ``prompt_logprobs = k`` the same for each prompt token after the first (with ranks), computed in
    the prefill (such a request takes no prefix-cache hit until they are complete).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # per prompt token after the first: its logprob, rank and the top k
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = _int_list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        if self.temperature < _GREEDY_TEMPERATURE:
            self.temperature, self.top_p, self.top_k, self.min_p = 0.0, 1.0, 0, 0.0

    def validate(self) -> None:
        """Check every field again (the engine does, on admission: the object is mutable)."""
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        def check_int(name: str, low: int, high: int, optional: bool = False) -> None:
            value = getattr(self, name)
            if optional and value is None:
                return
            check(_is_int(value) and low <= value <= high,
                  f"{name} must be an integer in [{low}, {high}], got {value!r}")

        def check_float(name: str, low: float, high: float, low_open: bool = False) -> None:
            value = getattr(self, name)
            ok = _is_number(value) and (low < value if low_open else low <= value) and value <= high
            check(ok, f"{name} must be a finite number in {'(' if low_open else '['}{format_bound(low)}, "
                      f"{format_bound(high)}], got {value!r}")

        check_int("n", 1, INT32_MAX)
        check_float("temperature", 0.0, MAX_TEMPERATURE)
        check_float("top_p", FLOAT32_MIN_NORMAL, 1.0)
        check(_is_int(self.top_k) and -1 <= self.top_k <= INT32_MAX,
              f"top_k must be -1 or 0 (disabled) or an integer in [1, {INT32_MAX}], got {self.top_k!r}")
        check_float("min_p", 0.0, 1.0)
        check_int("seed", INT64_MIN, INT64_MAX, optional=True)
        check_int("max_tokens", 1, INT32_MAX, optional=True)
        check_int("min_tokens", 0, INT32_MAX)
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
              f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        check_int("logprobs", 0, INT32_MAX, optional=True)  # the engine caps it (max_logprobs)
        check_int("prompt_logprobs", 0, INT32_MAX, optional=True)  # so it does this one
        check_float("presence_penalty", -2.0, 2.0)
        check_float("frequency_penalty", -2.0, 2.0)
        check_float("repetition_penalty", FLOAT32_MIN_NORMAL, MAX_REPETITION_PENALTY)
        check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        check(all(0 <= t <= INT32_MAX for t in self.stop_token_ids),
              f"stop_token_ids must hold token ids in [0, {INT32_MAX}]")
        check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs must be a StructuredOutputsParams")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def for_child(self, index: int) -> SamplingParams:
        """Parameters of the ``index``-th of ``n`` samples: n = 1, and a distinct seed when seeded; the
        prompt logprobs are the first sample's to compute (the others share its prompt blocks)."""
        # the children's seeds stay in int64, wrapping around at the top
        seed = None if self.seed is None else (self.seed + index - INT64_MIN) % 2**64 + INT64_MIN
        return replace(self, n=1, seed=seed, prompt_logprobs=self.prompt_logprobs if index == 0 else None)
