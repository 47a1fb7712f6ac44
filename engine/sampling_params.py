"""Sampling parameters of one request, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import Enum

MAX_LOGPROBS = 20
_GREEDY_TEMPERATURE = 1e-5


class RequestOutputKind(Enum):
    CUMULATIVE = "cumulative"  # every output carries everything generated so far
    DELTA = "delta"  # every output carries only what is new since the last one (streaming)
    FINAL_ONLY = "final_only"  # one output, when the request finishes


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Defaults follow the OpenAI / vLLM conventions.

    ``temperature == 0`` is greedy. ``top_k`` 0 or -1 and ``top_p == 1`` disable those filters. ``seed``
    makes a request's samples independent of whatever else shares its batch. ``logprobs = k`` returns,
    per generated token, the log-probabilities of the k most likely tokens plus the chosen one.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        if self.temperature < _GREEDY_TEMPERATURE:
            self.temperature, self.top_p, self.top_k, self.min_p = 0.0, 1.0, 0, 0.0

    def _validate(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        check(math.isfinite(self.temperature) and self.temperature >= 0,
              f"temperature must be >= 0, got {self.temperature}")
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        check(isinstance(self.top_k, int) and self.top_k >= 0,
              f"top_k must be -1 or 0 (disabled) or a positive integer, got {self.top_k!r}")
        check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        check(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
              f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0,
              f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
              f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
              f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        check(-2.0 <= self.presence_penalty <= 2.0,
              f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        check(-2.0 <= self.frequency_penalty <= 2.0,
              f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        check(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative token ids")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def for_child(self, index: int) -> SamplingParams:
        """Parameters of the ``index``-th of ``n`` samples: n = 1, and a distinct seed when seeded."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)
