"""Online load against a running kvserve (OpenAI API): fixed concurrency over one workload,
streamed, with time to first token; the offline engine on the same workload for comparison."""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx


async def _one(client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int, stream: bool) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": stream, "stream_options": {"include_usage": True} if stream else None}
    start = time.perf_counter()
    if not stream:
        response = await client.post("/v1/completions", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        latency = time.perf_counter() - start
        return {"tokens": response.json()["usage"]["completion_tokens"], "latency_s": latency, "ttft_s": latency}
    first = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"tokens": tokens, "latency_s": time.perf_counter() - start, "ttft_s": first or 0.0}


async def run_load(base_url: str, model: str, prompts: list[list[int]], output_len: int, concurrency: int,
                   api_key: str | None = None, stream: bool = True) -> dict:
    """All ``prompts`` with at most ``concurrency`` in flight; output tokens/s over the whole run.
    Streamed requests measure the time to first token; unstreamed ones count it as the latency."""
    gate = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=600, limits=limits) as client:
        async def gated(prompt):
            async with gate:
                return await _one(client, model, prompt, output_len, stream)

        start = time.perf_counter()
        results = await asyncio.gather(*(gated(p) for p in prompts))
        elapsed = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    ttfts = sorted(r["ttft_s"] for r in results)
    return {"concurrency": concurrency, "stream": stream, "requests": len(prompts), "output_tokens": tokens, "elapsed_s": elapsed,
            "output_tokens_per_s": tokens / elapsed, "ttft_p50_s": statistics.median(ttfts),
            "latency_p50_s": statistics.median(r["latency_s"] for r in results)}


def run_offline(model_dir: str, prompts: list[list[int]], output_len: int, **engine_kwargs) -> dict:
    """The same workload through the offline engine in this process, all submitted at once."""
    from engine import LLM, SamplingParams

    with LLM(model=model_dir, **engine_kwargs) as llm:
        llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0.0, max_tokens=2))
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
        elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"output_tokens": tokens, "elapsed_s": elapsed, "output_tokens_per_s": tokens / elapsed}
