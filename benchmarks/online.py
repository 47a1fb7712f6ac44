"""Online load against a running kvserve over its OpenAI API: open-loop Poisson arrivals at a given
rate, or a fixed number of requests in flight. Every request streams, with ``return_token_ids`` so
each chunk's tokens are counted exactly; the server's /metrics is polled for the prefix hit rate,
KV usage and waste, and preemptions over the run."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import Callable

import httpx

from benchmarks.records import RequestRecord, summarize
from benchmarks.workloads import Workload

_SAMPLE = re.compile(r"^kvserve:(\w+)\{[^}]*\} (\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    """kvserve's gauges and counters from /metrics, counters summed over replicas, gauges averaged
    (peaks take the largest)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    peaks: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            name, value = match.group(1), float(match.group(2))
            sums[name] = sums.get(name, 0.0) + value
            counts[name] = counts.get(name, 0) + 1
            peaks[name] = max(peaks.get(name, value), value)
    return {name: (peaks[name] if "peak" in name else sums[name] if name.endswith("_total") or
                   name.startswith("num_requests") else sums[name] / counts[name]) for name in sums}


async def _metrics(client: httpx.AsyncClient) -> dict[str, float]:
    response = await client.get("/metrics")
    return parse_metrics(response.text) if response.status_code == 200 else {}


async def _one(client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int,
               record: RequestRecord, stream: bool, cache_salt: str | None) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": stream, "return_token_ids": True, "cache_salt": cache_salt}
    token_ids: list[int] = []
    try:
        if not stream:  # the whole completion arrives at once: its first token is its last
            response = await client.post("/v1/completions", json=body)
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {response.text[:200]}"
            else:
                token_ids = response.json()["choices"][0]["token_ids"]
                record.add_tokens(len(token_ids), time.perf_counter())
            record.end = time.perf_counter()
            return token_ids
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return token_ids
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                for choice in json.loads(line[6:]).get("choices", ()):
                    ids = choice.get("token_ids") or []
                    record.add_tokens(len(ids), now)
                    token_ids.extend(ids)
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.end = time.perf_counter()
    return token_ids


async def run_online(base_url: str, model: str, workload: Workload, *, concurrency: int | None = None,
                     request_rate: float | None = None, seed: int = 0, api_key: str | None = None,
                     name: str | None = None, progress: Callable[[int], None] | None = None,
                     stream: bool = True, cache_salt: str | None = None, poll_s: float = 1.0) -> dict:
    """Run ``workload`` against ``base_url``. With ``request_rate``, requests arrive as a Poisson
    process (exponential gaps, seeded) whatever the server's pace; with ``concurrency``, at most that
    many are in flight. A later turn of a conversation goes out when the turn before it has
    finished (and, under a rate, not before its own arrival time). A fresh ``cache_salt`` per run
    starts it with a cold prefix cache on a server that has served the same prompts before."""
    if (concurrency is None) == (request_rate is None):
        raise ValueError("give exactly one of concurrency and request_rate")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = concurrency or len(workload.requests)
    predecessor = workload.predecessor()
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in workload.requests:
        arrivals.append(t)
        t += rng.expovariate(request_rate) if request_rate else 0.0
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=900,
                                 limits=httpx.Limits(max_connections=limit + 4)) as client:
        before = await _metrics(client)
        gate = asyncio.Semaphore(limit)
        done = {i: asyncio.Event() for i in range(len(workload.requests))}
        records = [RequestRecord(len(r.prompt), 0.0) for r in workload.requests]
        token_ids: list[list[int]] = [[] for _ in workload.requests]
        start = time.perf_counter()

        async def send(i: int) -> None:
            request = workload.requests[i]
            try:
                await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
                if i in predecessor:
                    await done[predecessor[i]].wait()
                async with gate:
                    records[i].arrival = time.perf_counter()
                    token_ids[i] = await _one(client, model, request.prompt, request.output_len, records[i],
                                              stream, cache_salt)
            finally:
                done[i].set()
                if progress:
                    progress(1)

        timeline: list[dict] = []
        peak = {"kv_cache_usage": -1.0}

        async def poll() -> None:
            while True:
                sample = await _metrics(client)
                now = time.perf_counter() - start
                if sample:
                    queries = sample.get("prefix_cache_queries_total", 0) - before.get("prefix_cache_queries_total", 0)
                    hits = sample.get("prefix_cache_hits_total", 0) - before.get("prefix_cache_hits_total", 0)
                    usage = sample.get("kv_cache_usage_perc", 0.0)
                    timeline.append({"t": now, "prefix_cache_hit_rate": hits / queries if queries else 0.0,
                                     "kv_cache_usage": usage, "num_running": sample.get("num_requests_running", 0)})
                    if usage > peak["kv_cache_usage"]:
                        peak.update(kv_cache_usage=usage, waste=sample.get("kv_cache_waste_perc", 0.0))
                await asyncio.sleep(poll_s)

        poller = asyncio.create_task(poll())
        await asyncio.gather(*(send(i) for i in range(len(workload.requests))))
        elapsed = time.perf_counter() - start
        poller.cancel()
        after = await _metrics(client)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in
             ("prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total")}
    queries, hits = delta["prefix_cache_queries_total"], delta["prefix_cache_hits_total"]
    label = (f"c{concurrency}" if concurrency else f"r{request_rate:g}") + ("" if stream else "-unstreamed")
    return summarize(
        name or f"kvserve-serve-http-{label}", records, elapsed, mode="online", concurrency=concurrency,
        request_rate=request_rate,
        prefix_cache_hit_rate=(hits / queries if queries else 0.0) if after else None,
        kv_cache_usage_peak=peak["kv_cache_usage"] if timeline else None,
        kv_waste_at_peak=peak.get("waste") if timeline else None,
        num_preemptions=int(delta["num_preemptions_total"]) if after else None,
        timeline=timeline, token_ids=token_ids,
    )
