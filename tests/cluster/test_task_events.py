"""kvserve's actors keep Ray's GCS from growing with traffic: the calls made per request, per engine
step and per second (scheduler actor, worker actors at tp > 1) record no task events, while the
rare ``shutdown`` calls still do. Read from GCS's task-event store, as the dashboard's task list is."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from engine import SamplingParams, engine_config
from tests.e2e.prompts import test_prompts as make_prompts

MAX_TOKENS = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
HOT_PATH = {f"SchedulerActor.{m}" for m in (
    "add_request", "subscribe", "wait_finished", "generate", "generate_full", "abort", "stats",
    "routing_stats", "ready")} | {"WorkerActor.execute_model"}
LIFECYCLE = {"SchedulerActor.shutdown", "WorkerActor.shutdown"}


def recorded_task_names() -> Counter:
    """How many tasks of each name GCS holds events for (owner and executor events count once)."""
    from ray._private.state import state

    tasks = {(e.task_id, e.attempt_number): e.task_info.name
             for e in state._get_all_task_events() if e.task_info.name}
    return Counter(tasks.values())


async def serve_requests(handle, prompts) -> dict[str, int]:
    """What the Serve replicas do per request: admit on the named actor, read the subscriber's
    stream, wait for the end; plus a streamed and a one-reply request, an abort and the periodic
    probes. Returns the number of tokens each request produced."""
    import ray

    tokens: Counter = Counter()
    ids = [f"r{i}" for i in range(len(prompts))]
    stream = handle.subscribe.remote("ingress-0")

    async def read() -> None:
        finished: set[str] = set()
        async for ref in stream:
            for request_id, output in await ref:
                tokens[request_id] += len(output.outputs[0].token_ids)
                if output.finished:
                    finished.add(request_id)
            if finished == set(ids):
                return

    reader = asyncio.ensure_future(read())
    for request_id, prompt in zip(ids, prompts):
        await handle.add_request.remote(request_id, prompt, PARAMS, None, "ingress-0")
    for request_id in ids:
        await handle.wait_finished.remote(request_id)
    await asyncio.wait_for(reader, timeout=60)
    ray.cancel(stream)
    async for ref in handle.generate.remote("streamed", prompts[0], PARAMS):
        tokens["streamed"] += len((await ref).outputs[0].token_ids)
    tokens["full"] = len((await handle.generate_full.remote("full", prompts[1], PARAMS)).outputs[0].token_ids)
    await handle.abort.remote("unknown")
    for probe in ("ready", "stats", "routing_stats"):
        await getattr(handle, probe).remote()
    return dict(tokens)


def test_hot_path_calls_record_no_task_events(ray_cluster, model_dirs):
    ray = ray_cluster
    from cluster.scheduler_actor import launch_scheduler_actor

    actor = launch_scheduler_actor(engine_config(model_dirs["opt"], tensor_parallel_size=2),
                                   name="engine:task-events", namespace="kvserve-test")
    prompts = make_prompts(model_dirs["opt"])[:3]
    handle = ray.get_actor("engine:task-events", namespace="kvserve-test")  # as the Ingress gets it
    tokens = asyncio.run(serve_requests(handle, prompts))
    assert tokens == {"r0": MAX_TOKENS, "r1": MAX_TOKENS, "r2": MAX_TOKENS, "streamed": MAX_TOKENS,
                      "full": MAX_TOKENS}
    ray.get(actor.shutdown.remote())
    # events reach GCS in batches (every second by default): once the shutdown calls, made after
    # every hot-path call, are there, so would the hot-path calls be
    deadline = time.monotonic() + 30
    names = recorded_task_names()
    while not LIFECYCLE <= set(names) and time.monotonic() < deadline:
        time.sleep(0.5)
        names = recorded_task_names()
    ray.kill(actor)
    assert LIFECYCLE <= set(names), f"the shutdown calls' events never reached GCS: {dict(names)}"
    assert names["SchedulerActor.shutdown"] == 1 and names["WorkerActor.shutdown"] == 2
    assert {n: names[n] for n in HOT_PATH if names[n]} == {}
