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
from collections.abc import Iterable
from dataclasses import dataclass, field

import httpx

# the malformed requests themselves live in benchmarks.fuzz_cases; re-exported here
from benchmarks.fuzz_cases import (  # noqa: F401
    CHAT_INT_FIELDS,
    FLOAT_FIELDS,
    GOOD_BODY,
    GOOD_PROMPT,
    INF,
    INT32_MAX,
    INT64_MAX,
    INT_FIELDS,
    LONE_SURROGATE,
    NAN,
    TEXT_FIELDS,
    Case,
    bad_float,
    bad_int,
    bad_text,
    chat_body,
    completion_body,
    encode,
    malformed_case,
    slow_schema,
)


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
