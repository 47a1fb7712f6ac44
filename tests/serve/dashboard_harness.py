"""Shared by the KV-map tests: the real FastAPI app with /dashboard over an in-process AsyncLLM on the
tiny llama (the openai_harness engine, its history sampled by a KVMonitor as the scheduler actor
does), requests held in flight with the engine paused between two steps, and /metrics read back."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

from api.http_app import build_openai_app
from api.metrics import prometheus_text
from api.openai_serving import AsyncLLMClient, OpenAIServing
from engine import SamplingParams
from engine.kv_map import KVMonitor
from engine.tokenizer import Tokenizer
from tests.serve.openai_harness import API_KEY, MODEL, REPLICA, parse_metrics

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def monitor(llm):
    # every poll built afresh: these tests compare each snapshot with the engine's state at that moment
    monitor = KVMonitor(llm.core.scheduler, llm.core.lock, period_s=0.5, min_interval_s=0).start()
    yield monitor
    monitor.stop()


def dashboard_app(llm, model_dir, monitor, api_key: str | None = API_KEY):
    """The app as the Serve Ingress builds it, for one replica named REPLICA."""
    serving = OpenAIServing(AsyncLLMClient(llm), Tokenizer(model_dir), MODEL, llm.core.config.max_model_len)

    async def metrics_text() -> str:
        return prometheus_text({REPLICA: llm.stats()}, MODEL)

    async def kv_map() -> dict:
        return {REPLICA: monitor.snapshot()}

    return build_openai_app(lambda: serving, api_key=api_key, metrics_text=metrics_text, kv_map=kv_map)


@pytest.fixture(scope="module")
def dash_app(llm, model_dir, monitor):
    return dashboard_app(llm, model_dir, monitor)


@contextlib.asynccontextmanager
async def engine_paused(llm):
    """Hold the engine between two steps: its step thread runs a wait instead of the next step, so
    the pool, the queues and the counters stand still (the engine's lock is free: reads go on)."""
    started, release = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        release.wait(120)

    held = llm._step_thread.submit(hold)
    try:
        assert await asyncio.to_thread(started.wait, 60), "the engine's step thread never came free"
        yield
    finally:
        release.set()
        await asyncio.wrap_future(held)


@contextlib.asynccontextmanager
async def requests_in_flight(llm, prompts: list[list[int]], max_tokens: int, min_step_s: float = 0.004):
    """Greedy requests running until the block exits (then aborted); entered once all run. While the
    block runs, every step takes at least ``min_step_s`` (the executor's call is padded), so the
    requests outlast a block of a second or two however fast the machine is."""
    async def consume(i: int, prompt: list[int]) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        async for _ in llm.generate(prompt, params, f"in-flight-{i}"):
            pass

    executor = llm.core.executor
    execute = executor.execute_model

    def padded(scheduler_output):
        start = time.monotonic()
        try:
            return execute(scheduler_output)
        finally:
            time.sleep(max(0.0, min_step_s - (time.monotonic() - start)))

    executor.execute_model = padded
    tasks = [asyncio.ensure_future(consume(i, p)) for i, p in enumerate(prompts)]
    try:
        deadline = asyncio.get_running_loop().time() + 60
        while llm.stats()["num_requests_running"] < len(prompts):
            assert not any(t.done() for t in tasks), "a request ended before all were running"
            assert asyncio.get_running_loop().time() < deadline, "the requests never all ran"
            await asyncio.sleep(0.005)
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        executor.execute_model = execute


def metric(text: str, name: str) -> float:
    """The one sample of ``name`` for this app's replica in a /metrics text."""
    labels = (("model_name", MODEL), ("replica", REPLICA))
    found = [samples[(name, labels)] for _, samples in parse_metrics(text).values() if (name, labels) in samples]
    assert len(found) == 1, f"{name}: {len(found)} samples"
    return found[0]


def assert_counts_match_metrics(replica: dict, metrics_text: str, counts: dict | None = None) -> None:
    """A replica's KV-map entry (or ``counts`` shown for it) against /metrics read at the same moment:
    held blocks (used + shared) are the KV usage gauge's share of the grid, running and waiting are
    the gauges, and the hit rate is the gauge."""
    counts = counts or replica["counts"]
    n = replica["num_blocks"]
    assert sum(counts[s] for s in ("free", "cached", "used", "shared")) == n
    usage = metric(metrics_text, "kvserve:kv_cache_usage_perc")
    assert (counts["used"] + counts["shared"]) / n == usage
    assert replica["num_requests_running"] == metric(metrics_text, "kvserve:num_requests_running")
    assert replica["num_requests_waiting"] == metric(metrics_text, "kvserve:num_requests_waiting")
    assert replica["prefix_cache_hit_rate"] == metric(metrics_text, "kvserve:prefix_cache_hit_rate")
