"""Fuzz the OpenAI HTTP API: malformed requests side by side with good ones.

    python -m benchmarks.fuzz --requests 2000 [--seed 0] [--concurrency 16] [--timeout 10]

Each malformed request is a valid completion or chat body with one thing broken: a numeric field out
of range or of the wrong type (huge and negative integers, fractions, NaN and infinities, strings,
lists), a text with a lone surrogate, an empty or oversized list, an unknown role, a missing field,
a body that is not a JSON object, work over the caps (``max_n``, ``max_stop_sequences``,
``max_stop_string_length``, ``max_logprobs``, ``max_prompts_per_request`` at their defaults), or a
feature the engine refuses (``priority``, ``prompt_logprobs`` with ``stream``). Meanwhile good greedy completions
run one after another, each of which must return the text the first one returned. The figures:

- ``tried``: malformed requests sent;
- ``error_body_4xx``: answered 4xx with an OpenAI error body ``{"error": {message, type, param, code}}``
  (the target is all of them);
- ``bad_4xx``: answered 4xx without that body; ``server_errors``: answered 5xx; ``accepted``: answered
  2xx (a malformed request the API let through); ``hangs``: no answer within ``--timeout``;
- ``good``, ``collateral``: good requests run beside them, and those that failed or returned another text;
- ``blocks_in_use``, ``requests_left``: what the engine holds once everything has finished (target 0).

The app is the real FastAPI app over an in-process engine on the tiny llama (built if missing), so
the figures measure the API's validation and error mapping, not the network. ``fuzz`` drives any app
(the test suite calls it with a small count).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

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


def is_error_body(response: httpx.Response) -> bool:
    """The OpenAI error body: {"error": {"message": non-empty str, "type": str, "param", "code"}}."""
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
            and isinstance(error["message"], str) and bool(error["message"]) and "\n" not in error["message"]
            and isinstance(error["type"], str))


@dataclass
class FuzzReport:
    tried: int = 0
    error_body_4xx: int = 0
    bad_4xx: int = 0
    server_errors: int = 0
    accepted: int = 0
    hangs: int = 0
    good: int = 0
    collateral: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)  # the first few, described

    @property
    def share_4xx(self) -> float:
        return self.error_body_4xx / self.tried if self.tried else math.nan

    def note(self, text: str) -> None:
        if len(self.failures) < 20:
            self.failures.append(text)

    def summary(self) -> dict:
        return {"tried": self.tried, "error_body_4xx": self.error_body_4xx,
                "share_4xx_with_error_body": round(self.share_4xx, 4), "bad_4xx": self.bad_4xx,
                "server_errors": self.server_errors, "accepted": self.accepted, "hangs": self.hangs,
                "good": self.good, "collateral": self.collateral, "seconds": round(self.seconds, 1),
                "failures": self.failures}


async def fuzz(client: httpx.AsyncClient, cases: Iterable[Case], expected_text: str | None = None, *,
               concurrency: int = 16, timeout_s: float = 10.0, good_streams: int = 2) -> FuzzReport:
    """Send ``cases`` (``concurrency`` at a time, each within ``timeout_s``) while ``good_streams``
    sequences of good greedy completions (``GOOD_BODY``) run beside them; each good one must return
    ``expected_text`` (default: what the first one returns)."""
    report = FuzzReport()
    slots = asyncio.Semaphore(concurrency)
    done = asyncio.Event()
    start = time.monotonic()

    async def one(case: Case) -> None:
        async with slots:
            try:
                response = await asyncio.wait_for(
                    client.post(case.path, content=case.body, headers={"Content-Type": case.content_type}), timeout_s)
            except asyncio.TimeoutError:
                report.hangs += 1
                report.note(f"hang: {case.what}: {case.body[:200]!r}")
                return
            except Exception as exc:  # the app raised through the transport: a crash
                report.server_errors += 1
                report.note(f"raised {type(exc).__name__}: {case.what}: {case.body[:200]!r}")
                return
        status = response.status_code
        if 400 <= status < 500 and is_error_body(response):
            report.error_body_4xx += 1
        elif 400 <= status < 500:
            report.bad_4xx += 1
            report.note(f"{status} without an error body: {case.what}: {response.text[:200]}")
        elif status >= 500:
            report.server_errors += 1
            report.note(f"{status}: {case.what}: {case.body[:200]!r} -> {response.text[:200]}")
        else:
            report.accepted += 1
            report.note(f"{status} (accepted): {case.what}: {case.body[:200]!r}")

    async def good_loop() -> None:
        nonlocal expected_text
        while True:
            try:
                response = await asyncio.wait_for(client.post("/v1/completions", json=GOOD_BODY), timeout_s)
                text = response.json()["choices"][0]["text"] if response.status_code == 200 else None
            except Exception as exc:  # noqa: BLE001 - any failure of a good request counts
                text, response = None, exc
            if expected_text is None and text is not None:
                expected_text = text
            report.good += 1
            if text is None or text != expected_text:
                report.collateral += 1
                report.note(f"good request failed: {getattr(response, 'text', response)!s:.200}")
            if done.is_set():
                return

    good = [asyncio.create_task(good_loop()) for _ in range(good_streams)]
    tasks = []
    for case in cases:
        report.tried += 1
        tasks.append(asyncio.create_task(one(case)))
    await asyncio.gather(*tasks)
    done.set()
    await asyncio.gather(*good)
    report.seconds = time.monotonic() - start
    return report


def add_fuzz_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=2000, help="malformed requests to send")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=16, help="malformed requests in flight")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds before a request counts as a hang")
    parser.add_argument("--good-streams", type=int, default=2, help="good requests in flight beside the fuzz")
    parser.add_argument("--model", help="model directory or Hugging Face repo id (default: the llama `tiny` preset, built if missing)")


def run_fuzz(args: argparse.Namespace) -> int:
    """Build the in-process app, fuzz it, print the figures as JSON; 0 when every target is met."""
    from api.http_app import build_openai_app
    from api.openai_serving import AsyncLLMClient, OpenAIServing
    from engine import AsyncLLM, engine_config
    from engine.tokenizer import Tokenizer
    from workers.model_builder import ensure_model

    model = args.model or str(ensure_model("llama", "tiny"))
    rng = random.Random(args.seed)
    cases = [malformed_case(rng) for _ in range(args.requests)]

    async def main() -> dict:
        llm = AsyncLLM(engine_config(model, num_kv_blocks=400))
        try:
            serving = OpenAIServing(AsyncLLMClient(llm), Tokenizer(model), "fuzz", llm.core.config.max_model_len)
            transport = httpx.ASGITransport(app=build_openai_app(lambda: serving))
            async with httpx.AsyncClient(transport=transport, base_url="http://fuzz") as client:
                alone = await client.post("/v1/completions", json=GOOD_BODY)  # the reference, with nothing beside it
                report = await fuzz(client, cases, alone.json()["choices"][0]["text"],
                                    concurrency=args.concurrency, timeout_s=args.timeout,
                                    good_streams=args.good_streams)
            await asyncio.sleep(0.5)
            stats = llm.stats()
            return {**report.summary(), "blocks_in_use": stats["num_blocks_in_use"],
                    "requests_left": stats["num_requests_running"] + stats["num_requests_waiting"]}
        finally:
            llm.shutdown()

    result = asyncio.run(main())
    print(json.dumps(result, indent=2))
    ok = (result["error_body_4xx"] == result["tried"] and result["collateral"] == 0
          and result["blocks_in_use"] == 0 and result["requests_left"] == 0)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_fuzz_arguments(parser)
    return run_fuzz(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
