"""The ranges every API accepts for the numeric request fields, and the text check.

One table for HTTP (the pydantic schemas of ``openai_protocol``) and gRPC (``grpc_serving``): integers
fit the types the engine and workers use (int32 counts and token ids, an int64 seed), floats are
finite and in a range that makes sense for the sampler (float32 on the workers). The engine's own
configurable caps (``max_n``, ``max_logprobs``, the number and length of stop strings, ...) and its
vocabulary check come after; the Ingress's own caps (prompts per request, body bytes) are at the end.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from engine.sampling_params import FLOAT32_MIN_NORMAL, format_bound

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0

# field -> (lowest, highest), both included
INT_RANGES: dict[str, tuple[int, int]] = {
    "n": (1, INT32_MAX),
    "best_of": (1, INT32_MAX),
    "max_tokens": (1, INT32_MAX),
    "max_completion_tokens": (1, INT32_MAX),
    "min_tokens": (0, INT32_MAX),
    "top_k": (-1, INT32_MAX),
    "seed": (INT64_MIN, INT64_MAX),
    # logprobs per token: the engine's max_logprobs (configurable, 20 by default) is the cap, not a constant
    "logprobs": (0, INT32_MAX),
    "top_logprobs": (0, INT32_MAX),
    "prompt_logprobs": (0, INT32_MAX),
    "truncate_prompt_tokens": (-1, INT32_MAX),  # -1: max_model_len; 0 is refused where it is applied
    "stop_token_ids": (0, INT32_MAX),  # each id
    "token_ids": (0, INT32_MAX),  # each prompt token id
}
# field -> (lowest, highest, lowest excluded); the highest is included, NaN and infinities never are
FLOAT_RANGES: dict[str, tuple[float, float, bool]] = {
    "temperature": (0.0, MAX_TEMPERATURE, False),
    "top_p": (FLOAT32_MIN_NORMAL, 1.0, False),  # float32 on the workers: smaller underflows
    "min_p": (0.0, 1.0, False),
    "presence_penalty": (-2.0, 2.0, False),
    "frequency_penalty": (-2.0, 2.0, False),
    "repetition_penalty": (FLOAT32_MIN_NORMAL, MAX_REPETITION_PENALTY, False),
}


def check_int(name: str, value: int, kind: str | None = None) -> None:
    """Raises ValueError naming ``name`` unless ``value`` is in the range of ``kind`` (default: ``name``)."""
    low, high = INT_RANGES[kind or name]
    if not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value}")


def check_ints(name: str, values: Iterable[int], kind: str | None = None) -> None:
    low, high = INT_RANGES[kind or name]
    for value in values:
        if not low <= value <= high:
            raise ValueError(f"{name} must hold integers in [{low}, {high}], got {value}")


def check_float(name: str, value: float) -> None:
    low, high, low_open = FLOAT_RANGES[name]
    opening = "(" if low_open else "["
    if not (math.isfinite(value) and (low < value if low_open else low <= value) and value <= high):
        raise ValueError(f"{name} must be a finite number in {opening}{format_bound(low)}, {format_bound(high)}], "
                         f"got {value}")


def valid_text(value: str) -> bool:
    """Whether ``value`` can be encoded as UTF-8 (a lone surrogate such as ``"\\ud800"`` cannot)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


TEXT_ERROR = "must be valid Unicode text: it holds a lone surrogate code point, which UTF-8 cannot encode"


# the Ingress's caps on one HTTP request (``AppArgs``; the engine's own caps are in ``EngineConfig``)
DEFAULT_MAX_PROMPTS_PER_REQUEST = 256  # prompts (texts or token-id lists) in one completion request
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 2**20  # bytes of one request body, checked before it is parsed


def check_prompt_count(count: int, cap: int) -> None:
    """Raises ValueError naming the cap when a completion request holds more than ``cap`` prompts."""
    if count > cap:
        raise ValueError(f"a completion request may hold at most {cap} prompts (the server's "
                         f"max_prompts_per_request), got {count}")
