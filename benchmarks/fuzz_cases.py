"""The fuzz driver's malformed requests: a valid completion or chat body with one thing broken (``malformed_case``)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1
NAN, INF = float("nan"), float("inf")
LONE_SURROGATE = "\ud800"
GOOD_PROMPT = "The sky at sunset is"
GOOD_BODY = {"prompt": GOOD_PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}

# field -> (lowest, highest) of the API's integer fields (api/limits.py)
INT_FIELDS = {"n": (1, INT32_MAX), "max_tokens": (1, INT32_MAX), "min_tokens": (0, INT32_MAX),
              "top_k": (-1, INT32_MAX), "seed": (-(2**63), INT64_MAX), "logprobs": (0, 20)}
CHAT_INT_FIELDS = {**{k: v for k, v in INT_FIELDS.items() if k != "logprobs"},
                   "max_completion_tokens": (1, INT32_MAX), "top_logprobs": (0, 20)}
# field -> (lowest, highest, lowest excluded)
FLOAT_FIELDS = {"temperature": (0.0, 100.0, False), "top_p": (0.0, 1.0, True), "min_p": (0.0, 1.0, False),
                "presence_penalty": (-2.0, 2.0, False), "frequency_penalty": (-2.0, 2.0, False),
                "repetition_penalty": (0.0, 100.0, True)}
TEXT_FIELDS = ("stop", "cache_salt", "user")


@dataclass
class Case:
    """One malformed request: where it goes, its raw body, and what is wrong with it."""

    path: str
    body: bytes
    what: str
    content_type: str = "application/json"


def encode(body: Any) -> bytes:
    """JSON as Python writes it: NaN and Infinity literals, lone surrogates as \\u escapes."""
    return json.dumps(body, allow_nan=True, ensure_ascii=True).encode()


def completion_body(rng: random.Random) -> dict:
    prompt = rng.choice(["Hello", "Once upon a time", [5, 6, 7], ["a", "b"], [[5, 6], [7, 8]]])
    return {"prompt": prompt, "max_tokens": rng.randint(1, 4)}


def chat_body(rng: random.Random) -> dict:
    content = rng.choice(["Hi", [{"type": "text", "text": "Hi"}]])
    return {"messages": [{"role": rng.choice(["system", "user"]), "content": "Be brief."},
                         {"role": "user", "content": content}], "max_tokens": rng.randint(1, 4)}


def bad_int(rng: random.Random, low: int, high: int) -> Any:
    """An integer field's value outside [low, high] or of the wrong type (never one pydantic coerces)."""
    return rng.choice([
        low - 1, low - rng.randint(2, 10**6), high + 1, high + rng.randint(2, 10**6), 2**63, 2**64, -(2**63) - 1,
        10**30, -(10**30), 10**400, rng.uniform(-10, 10) + 0.5, NAN, INF, -INF, "many", "", [1], {"v": 1},
    ] if low > -(2**63) else [INT64_MAX + 1, 2**64, -(2**63) - 1, 10**30, 10**400, 0.5, NAN, INF, "seed", [1], {}])


def bad_float(rng: random.Random, low: float, high: float, low_open: bool) -> Any:
    below = [low] if low_open else []
    return rng.choice([
        *below, low - rng.uniform(1e-3, 10), high + rng.uniform(1e-3, 10), high * 1e6 + 1, 1e308, -1e308, 10**400,
        -(10**400), NAN, INF, -INF, "warm", [0.5], {"v": 0.5},
    ])


def bad_text(rng: random.Random) -> Any:
    return rng.choice([f"a{LONE_SURROGATE}b", LONE_SURROGATE, "\udfff", 7, 1.5, {"t": "x"}, [1, 2]])


def slow_schema(rng: random.Random) -> dict:
    """A JSON schema past one of the engine's default structured-output bounds (each a 400): nested
    deeper than 64 levels, a count keyword over 4096, a pattern repeating more, or text over 65536."""
    kind = rng.randrange(4)
    if kind == 0:
        schema: dict = {"type": "integer"}
        for _ in range(rng.randint(33, 400)):
            schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        return schema
    if kind == 1:
        key = rng.choice(["maxLength", "minLength", "minItems", "maxItems", "minProperties", "maxProperties"])
        return {"type": "string" if "Length" in key else "array" if "Items" in key else "object",
                key: rng.randint(4097, 2**31 - 1)}
    if kind == 2:
        return {"type": "string", "pattern": "[a-z]{0,%d}" % rng.randint(4097, 10**9)}
    return {"type": "string", "enum": [f"v{i}" for i in range(rng.randint(9000, 20000))]}


def _completion_mutations(rng: random.Random) -> list[tuple[str, Callable[[dict], None]]]:
    def set_(key: str, value: Any) -> Callable[[dict], None]:
        return lambda body: body.__setitem__(key, value)

    out: list[tuple[str, Callable[[dict], None]]] = []
    for name, (low, high) in INT_FIELDS.items():
        out.append((f"{name} out of range or mistyped", set_(name, bad_int(rng, low, high))))
    for name, bounds in FLOAT_FIELDS.items():
        out.append((f"{name} out of range, NaN or mistyped", set_(name, bad_float(rng, *bounds))))
    for name in TEXT_FIELDS:
        out.append((f"{name} with a lone surrogate or mistyped", set_(name, bad_text(rng))))
    out += [
        ("prompt with a lone surrogate", set_("prompt", rng.choice([LONE_SURROGATE, ["ok", f"x{LONE_SURROGATE}"]]))),
        ("prompt token id out of range", set_("prompt", [5] * rng.randint(0, 40) + [rng.choice(
            [-1, -(2**63), 2**31, 2**63, 2**64, 10**30])] + [5] * rng.randint(0, 40))),
        ("prompt empty", set_("prompt", rng.choice([[], [[]], [[5], []]]))),
        ("prompt mistyped", set_("prompt", rng.choice([5, None, {"p": 1}, [1.5], [[[1]]], ["a", 1], [None], True]))),
        ("prompt longer than the context", set_("prompt", [5] * rng.randint(2049, 6000))),
        ("stop_token_ids out of range or mistyped", set_("stop_token_ids", rng.choice(
            [[-1], [2**31], [2**64], [5, "x"], 7, [1.5], [10**6]]))),
        ("stop empty or mistyped", set_("stop", rng.choice(["", [""], [1], {"s": 1}]))),
        ("n over the engine's max_n (128 by default)", set_("n", rng.randint(129, 20000))),
        ("stop strings over the engine's max_stop_sequences (64 by default)",
         set_("stop", [f"s{i}" for i in range(rng.randint(65, 1000))])),
        ("a stop string over the engine's max_stop_string_length (1024 by default)",
         set_("stop", ["s" * rng.randint(1025, 100_000)])),
        ("prompts over max_prompts_per_request (256 by default)", set_("prompt", [[5]] * rng.randint(257, 5000))),
        ("prompt_logprobs over max_logprobs, or with stream", rng.choice([
            set_("prompt_logprobs", rng.randint(21, 10**6)), lambda body: body.update(prompt_logprobs=1, stream=True)])),
        ("priority other than 0", set_("priority", rng.choice([1, -1, 10**6]))),
        ("a regex or grammar built to compile slowly (past the engine's structured_output bounds)", rng.choice([
            set_("guided_regex", rng.choice(["a{%d}" % rng.randint(4097, 10**9), "(" * 70 + "a" + ")" * 70,
                                             "[a-z]" * 20000])),
            set_("guided_grammar", 'root ::= "a"{1,%d}' % rng.randint(4097, 10**9))])),
        ("truncate_prompt_tokens 0, below -1 or over the context", set_("truncate_prompt_tokens",
                                                                        rng.choice([0, -2, 10**6]))),
        ("logit_bias given", set_("logit_bias", rng.choice([{"5": 1.0}, {"5": NAN}, {"x": "y"}, [1]]))),
        ("suffix given", set_("suffix", "!")),
        ("best_of other than n", set_("best_of", rng.choice([2, 3, 0, -1, 2**64]))),
        ("echo with logprobs", lambda body: body.update(echo=True, logprobs=1)),
        ("min_tokens above max_tokens", lambda body: body.update(max_tokens=2, min_tokens=5)),
        ("prompt missing", lambda body: body.pop("prompt")),
        ("stream mistyped", set_("stream", rng.choice(["maybe", [1], {"a": 1}, 2]))),
        ("stream_options mistyped", set_("stream_options", rng.choice([{"include_usage": "x"}, [1], "yes"]))),
    ]
    return out


def _chat_mutations(rng: random.Random) -> list[tuple[str, Callable[[dict], None]]]:
    def set_(key: str, value: Any) -> Callable[[dict], None]:
        return lambda body: body.__setitem__(key, value)

    def set_message(key: str, value: Any) -> Callable[[dict], None]:
        return lambda body: body["messages"][-1].__setitem__(key, value)

    out: list[tuple[str, Callable[[dict], None]]] = []
    for name, (low, high) in CHAT_INT_FIELDS.items():
        mutate = set_(name, bad_int(rng, low, high))
        if name == "top_logprobs":
            mutate = (lambda m: lambda body: (body.__setitem__("logprobs", True), m(body)))(mutate)
        out.append((f"{name} out of range or mistyped", mutate))
    for name, bounds in FLOAT_FIELDS.items():
        out.append((f"{name} out of range, NaN or mistyped", set_(name, bad_float(rng, *bounds))))
    out += [
        ("message content with a lone surrogate or mistyped", set_message("content", bad_text(rng))),
        ("message name with a lone surrogate or mistyped", set_message("name", bad_text(rng))),
        ("content part with a lone surrogate", set_message("content", [{"type": "text", "text": LONE_SURROGATE}])),
        ("content part not text", set_message("content", [{"type": rng.choice(["image_url", "audio", ""])}])),
        ("unknown role", set_message("role", rng.choice(["wizard", "", "USER", None, 5, LONE_SURROGATE]))),
        ("role missing", lambda body: body["messages"][-1].pop("role")),
        ("messages empty or mistyped", set_("messages", rng.choice([[], None, "hi", {"role": "user"}, [5], [[]]]))),
        ("messages missing", lambda body: body.pop("messages")),
        ("messages longer than the context", set_("messages", [{"role": "user", "content": "word " * 400}] * 8)),
        ("tools malformed", set_("tools", rng.choice([[{"type": "function"}],
                                                      [{"type": "function", "function": {"name": ""}}],
                                                      [{"type": "function", "function": {"name": "f", "parameters": 5}}]]))),
        ("tool_choice without tools", set_("tool_choice", "required")),
        ("response_format malformed", set_("response_format", rng.choice([{"type": "xml"}, {"type": "json_schema"}]))),
        ("a schema built to compile slowly (past the engine's structured_output bounds)",
         set_("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": slow_schema(rng)}})),
        ("top_logprobs without logprobs", set_("top_logprobs", rng.randint(1, 20))),
        ("logprobs mistyped", set_("logprobs", rng.choice(["x", [1], {"a": 1}]))),
        ("stop with a lone surrogate or mistyped", set_("stop", bad_text(rng))),
    ]
    return out


def _structural(rng: random.Random) -> Case:
    path = rng.choice(["/v1/completions", "/v1/chat/completions"])
    body, what, content_type = rng.choice([
        (b'{"prompt": "x",', "malformed JSON", "application/json"),
        (b"", "empty body", "application/json"),
        (b"[1, 2]", "a JSON list", "application/json"),
        (b'"text"', "a JSON string", "application/json"),
        (b"null", "JSON null", "application/json"),
        (b'{"prompt": "\xff\xfe"}', "invalid UTF-8", "application/json"),
        (b"prompt=x", "a form body", "application/x-www-form-urlencoded"),
        (b'{"prompt": "x"}', "plain text content type", "text/plain"),
        (b'{"prompt": "x", "max_tokens": 1e999999}', "a number JSON cannot hold", "application/json"),
        (b'{"prompt": ' * 200 + b'"x"' + b"}" * 200, "deeply nested", "application/json"),
    ])
    return Case(path, body, what, content_type)


def malformed_case(rng: random.Random) -> Case:
    """One malformed request (see the module docstring)."""
    kind = rng.random()
    if kind < 0.1:
        return _structural(rng)
    if kind < 0.15:
        path = rng.choice(["/v1/completions", "/v1/chat/completions"])
        body = completion_body(rng) if path == "/v1/completions" else chat_body(rng)
        body["model"] = rng.choice(["gpt-9", "", LONE_SURROGATE, 5])
        return Case(path, encode(body), "unknown or mistyped model")
    if kind < 0.6:
        body = completion_body(rng)
        what, mutate = rng.choice(_completion_mutations(rng))
        mutate(body)
        return Case("/v1/completions", encode(body), what)
    body = chat_body(rng)
    what, mutate = rng.choice(_chat_mutations(rng))
    mutate(body)
    return Case("/v1/chat/completions", encode(body), what)
