"""How fast an overloaded app says no: ``python -m benchmarks.overload``.

Starts the Serve app as ``kvserve chaos`` does (a local Ray cluster with this machine's CPUs, Serve's
HTTP proxy on a free port) with one LLMServer replica holding a small engine (``max_num_seqs`` +
``max_waiting_requests`` requests), then sends ``--requests`` completions at once, ``--rounds``
times. Every request is timed from the moment the client sends it; the report gives, per round, the
statuses, and the latency (p50 / p99 / max) of the refusals (503) and of the completions (200), as the
client saw it and, for the refusals, as the Ingress did (its ``Server-Timing``: from the request's
arrival there to its answer). Before each burst the same number of GET /version requests are sent at
once (``version_burst``): what the proxy, the Ingress replica and the client take for a route that
does nothing::

    python -m benchmarks.overload --requests 300 --rounds 3 --out overload.json

Without ``--model`` the tiny llama preset is built into a temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from benchmarks.chaos import MODEL_NAME, start_app, stop_app


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def summary(latencies: list[float]) -> dict:
    ms = [1000 * s for s in latencies]
    return {"count": len(ms), **{name: None if (v := percentile(ms, q)) is None else round(v, 1)
                                 for name, q in (("p50_ms", 50), ("p99_ms", 99), ("max_ms", 100))}}


async def burst(url: str, requests: int, max_tokens: int, timeout: float) -> dict:
    """``requests`` completions sent at once; the statuses and the latencies of each kind."""
    body = {"model": MODEL_NAME, "prompt": "An overloaded server should answer quickly.", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0}
    limits = httpx.Limits(max_connections=requests, max_keepalive_connections=requests)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        await asyncio.gather(*(http.get(f"{url}/version") for _ in range(requests)))  # every connection open
        gate = asyncio.Event()

        async def one() -> tuple[int | str, str | None, float, float | None]:
            await gate.wait()
            start = time.monotonic()
            try:
                r = await http.post(f"{url}/v1/completions", json=body)
            except httpx.HTTPError as exc:
                return type(exc).__name__, None, time.monotonic() - start, (None, None)
            code = r.json().get("error", {}).get("code") if r.status_code != 200 else None
            timing = r.headers.get("server-timing")
            return r.status_code, code, time.monotonic() - start, (ingress_seconds(timing),
                                                                   ingress_seconds(timing, "gate"))

        async def trivial() -> float:  # the same burst's cost on a route that does nothing: Serve's share
            await gate.wait()
            start = time.monotonic()
            await http.get(f"{url}/version")
            return time.monotonic() - start

        gate.set()
        floor = await asyncio.gather(*(trivial() for _ in range(requests)))
        gate.clear()
        tasks = [asyncio.ensure_future(one()) for _ in range(requests)]
        await asyncio.sleep(0.1)
        gate.set()
        results = await asyncio.gather(*tasks)
    statuses = Counter(f"{status} {code}".strip() if code else str(status) for status, code, _, _ in results)
    return {"statuses": dict(statuses),
            "refused": summary([t for status, _, t, _ in results if status == 503]),
            "refused_at_ingress": summary([t[0] for status, _, _, t in results if status == 503 and t[0] is not None]),
            "refused_at_gate": summary([t[1] for status, _, _, t in results if status == 503 and t[1] is not None]),
            "served": summary([t for status, _, t, _ in results if status == 200]),
            "version_burst": summary(floor)}


def ingress_seconds(header: str | None, name: str = "ingress") -> float | None:
    """``Server-Timing: ingress;dur=<ms>`` (the Ingress's time from a request's arrival to its answer),
    or another of its metrics (``gate``: the part until the Ingress's gate had decided)."""
    for metric in (header or "").split(","):
        metric_name, _, params = metric.strip().partition(";")
        if metric_name == name and params.startswith("dur="):
            return float(params[4:]) / 1000
    return None


def run_overload(model: str | None, requests: int, rounds: int, max_tokens: int, timeout: float,
                 **app_args) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        if model is None:
            from workers.model_builder import make_model

            model = str(make_model("llama", "tiny", Path(scratch) / "tiny-llama", seed=0))
        url = start_app(model, 1, **app_args)
        try:
            report = {"requests": requests, "max_tokens": max_tokens, "app_args": app_args, "rounds": []}
            for i in range(rounds):
                result = asyncio.run(burst(url, requests, max_tokens, timeout))
                print(f"[overload] round {i + 1}: {result}", flush=True)
                report["rounds"].append(result)
                time.sleep(1.0)
            return report
        finally:
            stop_app()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--max-waiting-requests", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    report = run_overload(args.model, args.requests, args.rounds, args.max_tokens, args.timeout,
                          max_num_seqs=args.max_num_seqs, max_waiting_requests=args.max_waiting_requests,
                          num_kv_blocks=256)
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
