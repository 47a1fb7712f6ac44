"""RSS growth per request of an async Ray actor under the scheduler actor's call pattern.

What the Serve app does per request, against one actor made with the options of
``launch_scheduler_actor`` (max_concurrency 10000, task events off):

    add_request(id, prompt, params, None, subscriber)        the LLMServer replica: admission
    wait_finished(id)                                          the LLMServer replica: open until the end
    abort(id), twice for a cut stream (LLMServer + Ingress)    a fifth of the requests
    subscribe(subscriber)                                      the Ingress: one long streaming call,
                                                               one list per engine step

The actor is either a stand-in (``FakeScheduler``: the bookkeeping of cluster/scheduler_actor.py and
a step loop that emits a delta per request every ``--step-ms``, ``--steps`` per request) or, with
``--real``, the SchedulerActor itself on a tiny llama built with the project's model builder.

Each variant runs on a fresh actor: ``--warmup`` requests, then ``--requests`` more with the actor's
RSS (and, in the stand-in, its gc object count) sampled every ``--every``; reported: the
least-squares slope in bytes per request after the warm-up. Variants (``--variants``, comma list):

    full        the whole pattern above
    no_stream   no subscribe call: add_request names no subscriber (the step loop still runs)
    no_wait     no wait_finished call
    no_abort    no aborts
    no_add_wait only the stream (add_request's work done by a call that returns at once: noop)
    noop        one trivial async call per request (Ray's own per-call cost)
    noop_sync   one trivial sync call per request
    noop_dict   one async call per request returning a dict
    noop_params one async call per request taking a SamplingParams argument
    gen_short   one short-lived streaming call per request (3 items) instead of the shared stream

What it found (2 cores, Ray 2.60, Python 3.11; bytes per request after the warm-up):

    stand-in   full 135, no_wait 91, no_abort 154, noop 61, noop_dict 72 (levelling off: allocator
               and Ray per-call noise; no Python objects kept: ~0 gc objects per request)
    --real     full 1065-1259 with the default pool (32768 blocks), 1.8 KV blocks made per request,
               +1 KVCacheBlock and +0.5 dict (prefix-cache entry) per request;
               full 357-427 with --num-kv-blocks 512 (pool already made: 0 blocks made, 0 gc
               objects per request; tracemalloc: 261 B/request of Python memory, a quarter of it the
               routing report's change log, engine/prefix_report.py RecentHashes, bounded at 65536)
    in-process AsyncLLM, same load (no Ray): ~1000 with the default pool, 32 with 512 blocks

So the actor layer keeps nothing per request: the growth is the engine's KV pool making a
KVCacheBlock (and its prefix-cache entry, hash, token ids) the first time a request takes a fresh
block id (engine/block_pool.py: fresh ids are handed out before any freed block is evicted), ~700 B
per block, bounded by num_kv_blocks (~23 MB at 32768 blocks, reached after ~18k soak requests).
In the soak (``kvserve soak --minutes 8 --warmup 60 --app-arg num_kv_blocks=1024``, 12.4 requests/s),
whose pool is made during the warm-up, the scheduler actor grew 0.5-0.6 MB per 30 s for 2 minutes,
then 0.1 MB per 30 s (~270 B/request), against a steady 0.8 MB per 30 s with the default pool.

Run:  RAY_AUTH_MODE=disabled .venv/bin/python -m benchmarks.actor_memory [--variants full,noop]
      RAY_AUTH_MODE=disabled .venv/bin/python -m benchmarks.actor_memory --real --variants full \
          --warmup 1000 --requests 5000 --every 500 [--num-kv-blocks 512] [--tracemalloc]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import time
from dataclasses import dataclass

import ray

from cluster.scheduler_actor import _Subscriber

VARIANTS = ("full", "no_stream", "no_wait", "no_abort", "no_add_wait", "noop", "noop_sync", "noop_dict",
            "noop_params", "gen_short")


def rss_bytes(pid: int | None = None) -> int:
    with open(f"/proc/{pid or os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class _Probe:
    """Debug methods shared by both actors."""

    def probe(self) -> dict:
        import tracemalloc

        info = {"rss": rss_bytes(), "objects": len(gc.get_objects()),
                "traced": tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else None}
        engine = getattr(self, "engine", None)
        if engine is not None:  # the real actor: KV blocks made into objects so far, and cached ones
            pool = engine.core.scheduler.kv.block_pool
            info.update(blocks_made=len(pool.blocks), blocks_cached=pool.num_cached_blocks, blocks_total=pool.num_blocks)
        return info

    def type_counts(self) -> dict:
        """gc-tracked objects by type name (diff two calls to see what piles up)."""
        from collections import Counter

        gc.collect()
        return dict(Counter(type(o).__name__ for o in gc.get_objects()))

    def trace_start(self) -> None:
        import tracemalloc

        tracemalloc.start(8)
        self._snapshot = tracemalloc.take_snapshot()

    def trace_top(self, n: int = 15) -> list[str]:
        import tracemalloc

        gc.collect()
        stats = tracemalloc.take_snapshot().compare_to(self._snapshot, "traceback")
        return ["\n".join(s.traceback.format()[-6:]) + f"\n  +{s.size_diff} B, +{s.count_diff} blocks"
                for s in stats[:n]]


@dataclass
class _Item:
    """A fake step's output for one request: what ``_Subscriber.push`` reads (``finished``)."""

    id: str
    token_ids: list[int]
    text: str
    finished: bool


class FakeScheduler(_Probe):
    """SchedulerActor's per-request bookkeeping with a fake step loop instead of an engine."""

    def __init__(self, step_ms: float, steps: int) -> None:
        self._subscribers: dict[str, _Subscriber] = {}  # the scheduler actor's own
        self._finished: dict[str, asyncio.Event] = {}
        self._running: dict[str, list] = {}  # id -> [subscriber, steps left]
        self.step_s, self.steps = step_ms / 1000, steps
        self._loop_task = None

    def _sub(self, name: str) -> _Subscriber:
        return self._subscribers.setdefault(name, _Subscriber())

    async def _step_loop(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            for request_id, entry in list(self._running.items()):
                entry[1] -= 1
                finished = entry[1] <= 0
                sub = self._subscribers.get(entry[0])
                if sub is not None:
                    sub.push(request_id, _Item(request_id, [1], "x", finished))
                if finished:
                    del self._running[request_id]
                    done = self._finished.pop(request_id, None)
                    if done is not None:
                        done.set()

    async def add_request(self, request_id, prompt, params, cache_salt, subscriber) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())
        self._running[request_id] = [subscriber, self.steps]
        if subscriber:
            self._sub(subscriber).request_ids.add(request_id)
        self._finished[request_id] = asyncio.Event()

    async def subscribe(self, subscriber: str):
        sub = self._sub(subscriber)
        try:
            while True:
                await sub.ready.wait()
                sub.ready.clear()
                batch, sub.pending = sub.pending, []
                yield batch
        finally:
            self._subscribers.pop(subscriber, None)

    async def wait_finished(self, request_id: str) -> None:
        done = self._finished.get(request_id)
        if done is not None:
            await done.wait()

    def abort(self, request_id: str) -> None:
        entry = self._running.get(request_id)
        if entry is not None:
            entry[1] = 1  # ends at the next step, as an abort does

    def sizes(self) -> dict:
        return {"subscribers": len(self._subscribers), "finished": len(self._finished), "running": len(self._running),
                "pending": sum(len(s.pending) for s in self._subscribers.values())}

    async def noop(self, *args) -> None:
        return None

    def noop_sync(self, *args) -> None:
        return None

    async def noop_dict(self, *args) -> dict:
        return {"pid": 1, "num_kv_blocks": 2}

    async def gen(self, request_id: str):
        for _ in range(3):
            await asyncio.sleep(0)
            yield [(request_id, {"token_ids": [1]})]


def _params():
    from engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


async def _drive(actor, variant: str, total: int, concurrency: int, on_progress, prompt) -> None:
    """``total`` requests of ``variant`` at ``concurrency``; ``on_progress(n)`` after each."""
    params = _params()
    subscriber = "ingress-0"
    stream = reader = None
    if variant in ("full", "no_wait", "no_abort", "no_add_wait"):
        stream = actor.subscribe.remote(subscriber)

        async def read() -> None:
            async for ref in stream:
                await ref

        reader = asyncio.ensure_future(read())
    counter = iter(range(total))
    done = 0

    async def one(n: int) -> None:
        rid = f"req-{os.urandom(16).hex()}"
        text = prompt.format(n=n) if isinstance(prompt, str) else prompt
        if variant.startswith("noop"):
            if variant == "noop_params":
                await actor.noop.remote(rid, text, params, None, subscriber)
            else:
                await getattr(actor, variant).remote()
            return
        if variant == "gen_short":
            async for ref in actor.gen.remote(rid):
                await ref
            return
        if variant == "no_add_wait":
            await actor.noop.remote(rid, text, params, None, subscriber)
            return
        await actor.add_request.remote(rid, text, params, None, subscriber if stream is not None else "")
        cut = variant != "no_abort" and n % 5 == 4
        if cut:
            actor.abort.remote(rid)  # the Ingress's, and the LLMServer's after its call is cancelled
            actor.abort.remote(rid)
        if variant != "no_wait":
            await actor.wait_finished.remote(rid)
        else:
            await asyncio.sleep(0.02)

    async def worker() -> None:
        nonlocal done
        for n in counter:
            await one(n)
            done += 1
            on_progress(done)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    if stream is not None:
        reader.cancel()
        ray.cancel(stream)


def _slope(points: list[tuple[int, int]]) -> float:
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


def measure(make_actor, variant: str, warmup: int, requests: int, every: int, concurrency: int,
            prompt, trace: bool = False) -> dict:
    actor = make_actor()
    samples: list[tuple[int, int, int]] = []
    marks = set(range(warmup, warmup + requests + 1, every))
    types_before = None
    blocks: list[tuple[int, int, int, int]] = []
    traced: list[tuple[int, int]] = []

    def on_progress(n: int) -> None:
        if n in marks:
            if n == warmup:
                nonlocal types_before
                types_before = ray.get(actor.type_counts.remote())
                if trace:
                    ray.get(actor.trace_start.remote())
            info = ray.get(actor.probe.remote())
            samples.append((n - warmup, info["rss"], info["objects"]))
            if info["traced"] is not None:
                traced.append((n - warmup, info["traced"]))
            if "blocks_made" in info:
                blocks.append((n - warmup, info["blocks_made"], info["blocks_cached"], info["blocks_total"]))

    started = time.monotonic()
    asyncio.run(_drive(actor, variant, warmup + requests, concurrency, on_progress, prompt))
    elapsed = time.monotonic() - started
    result = {"variant": variant, "requests_per_s": round((warmup + requests) / elapsed),
              "bytes_per_request": round(_slope([(x, r) for x, r, _ in samples])),
              "objects_per_request": round(_slope([(x, o) for x, _, o in samples]), 3),
              "rss_mb": [round(r / 2**20, 1) for _, r, _ in samples]}
    if traced:  # what Python allocated and still holds (tracemalloc), against the RSS
        result["traced_bytes_per_request"] = round(_slope(traced))
    if blocks:
        result.update(blocks_made_per_request=round(_slope([(x, m) for x, m, _, _ in blocks]), 3),
                      blocks_made=[blocks[0][1], blocks[-1][1]], blocks_cached=[blocks[0][2], blocks[-1][2]],
                      num_kv_blocks=blocks[-1][3])
    if hasattr(actor, "sizes"):
        try:
            result["sizes"] = ray.get(actor.sizes.remote())
        except AttributeError:
            pass
    if types_before is not None:
        after = ray.get(actor.type_counts.remote())
        grown = {k: v - types_before.get(k, 0) for k, v in after.items()}
        result["types_grown"] = dict(sorted(grown.items(), key=lambda kv: -kv[1])[:8])
    if trace:
        result["tracemalloc_top"] = ray.get(actor.trace_top.remote())
    ray.kill(actor)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default="full,no_stream,no_wait,no_abort,noop,noop_sync,noop_dict,noop_params,gen_short",
                        help="comma list; with --real only full, no_wait and no_abort apply")
    parser.add_argument("--warmup", type=int, default=3000)
    parser.add_argument("--requests", type=int, default=12000)
    parser.add_argument("--every", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--real", action="store_true", help="the SchedulerActor on a tiny llama")
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="--real: the engine's KV pool (default: the engine's own, 32768 at most on CPU)")
    parser.add_argument("--tracemalloc", action="store_true", help="top allocation sites in the actor (slow)")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    options = {"max_concurrency": 10_000, "enable_task_events": False, "num_cpus": 0}
    prompt = "A shared preamble for every client. Client 0, request {n}:"  # a new one per request, as the soak's
    if args.real:
        import tempfile

        from cluster.scheduler_actor import SchedulerActor
        from engine import engine_config
        from workers.model_builder import make_model

        model = make_model("llama", "tiny", os.path.join(tempfile.mkdtemp(), "llama-tiny"), seed=0)
        config = engine_config(str(model), num_kv_blocks=args.num_kv_blocks)
        cls = type("SchedulerActor", (SchedulerActor, _Probe), {})

        def make_actor():
            actor = ray.remote(cls).options(**options).remote(config)
            ray.get(actor.ready.remote())
            return actor

    else:
        def make_actor():
            return ray.remote(FakeScheduler).options(**options).remote(args.step_ms, args.steps)

    for variant in args.variants.split(","):
        result = measure(make_actor, variant, args.warmup, args.requests, args.every, args.concurrency, prompt,
                         args.tracemalloc)
        top = result.pop("tracemalloc_top", None)
        print(result, flush=True)
        for line in top or ():
            print(line, flush=True)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
