"""The scheduler actor: one per engine instance. It owns the scheduler, the block tables and the
prefix cache, runs the step loop, and drives its tensor-parallel worker group.

Two ways to get outputs out:

    per request:   generate(id, prompt, params)  -> a streaming ObjectRefGenerator of that request's deltas
    multiplexed:   add_request(id, prompt, params, subscriber)  then  subscribe(subscriber) ->
                   one item per engine step holding the deltas of every request of that subscriber

The multiplexed form is what the Serve ingress uses: its cost per step is one Ray object whatever
the number of requests. At tensor_parallel_size 1 the model runs inside this actor (the in-process
executor); above, on worker actors. Cancelling a stream, or ``abort``, ends a request and frees its
blocks; a subscriber that goes away has its requests aborted.

Ray task events are off for this actor and the worker actors: GCS keeps the events of every call,
and the calls made per request, per step and per second would grow its memory for as long as the
app runs. ``shutdown`` keeps them (rare); ``KVSERVE_RAY_TASK_EVENTS=1`` where Ray starts (or in the
app's runtime_env) turns them all back on, to follow calls in the Ray dashboard.
"""

from __future__ import annotations

import asyncio
import os
import sys

import ray

from engine.async_engine import AsyncLLM
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.executor import create_executor
from engine.kv_map import KVMonitor
from engine.messages import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from workers.model_source import localize


TASK_EVENTS_ENV = "KVSERVE_RAY_TASK_EVENTS"


def task_events_enabled() -> bool:
    """Whether kvserve's actors record Ray task events for every call (``KVSERVE_RAY_TASK_EVENTS=1``)."""
    return os.environ.get(TASK_EVENTS_ENV) == "1"


class _Subscriber:
    """Outputs waiting for one subscriber, as (request id, output or error) pairs."""

    def __init__(self) -> None:
        self.pending: list[tuple[str, RequestOutput | BaseException]] = []
        self.ready = asyncio.Event()
        self.request_ids: set[str] = set()

    def push(self, request_id: str, item: RequestOutput | BaseException) -> None:
        self.pending.append((request_id, item))
        if isinstance(item, BaseException) or item.finished:
            self.request_ids.discard(request_id)
        self.ready.set()


class SchedulerActor:
    def __init__(self, config: EngineConfig, *, executor_kwargs: dict | None = None,
                 max_waiting_requests: int | None = None, torch_threads: int | None = None,
                 cpu_share: float | None = None, bind_threads: bool = False) -> None:
        """``torch_threads``: the engine's intra-op threads at tp = 1; None with ``cpu_share`` (the
        logical CPUs the engine and its serving actors reserve on this node): chosen from the node
        (``cluster.cpu_plan.default_threads``). ``bind_threads``: the step thread's OpenMP threads
        are bound to cores this engine claims on the node (CPU device, tp = 1)."""
        threads_line = topology = None
        if torch_threads or cpu_share:
            import torch

            if not torch_threads:
                from cluster.cpu_plan import cpu_topology, default_threads, physical_cores

                topology = cpu_topology()
                torch_threads = default_threads(cpu_share, len(topology), physical_cores(topology))
                threads_line = (f"{torch_threads} threads (this node: {physical_cores(topology)} physical cores, "
                                f"{len(topology)} logical CPUs; the engine and its serving actors reserve {cpu_share:g})")
            else:
                threads_line = f"{torch_threads} threads (torch_threads)"
            torch.set_num_threads(torch_threads)  # Ray pins OMP_NUM_THREADS=1 in actors
        config = localize(config)  # the checkpoint's copy on this node
        self.config = config
        core = EngineCore(config, create_executor(config, **(executor_kwargs or {})))
        self.engine = AsyncLLM(config, core=core, max_waiting_requests=max_waiting_requests)
        self.bound_cores: list[int] = []
        if threads_line is not None and config.device != "cuda" and config.parallel.world_size == 1:
            if bind_threads:
                from cluster.cpu_plan import bind_engine_threads

                self.bound_cores, why = self.engine.on_step_thread(bind_engine_threads, torch_threads, None, topology)
                threads_line += f", bound to cores {self.bound_cores}" if not why else f", {why}"
            print(f"kvserve engine: {threads_line}", file=sys.stderr, flush=True)
        self._subscribers: dict[str, _Subscriber] = {}
        self._finished: dict[str, asyncio.Event] = {}
        # the dashboard's KV map: sampled here, where the engine lives, so a new viewer sees history
        self.kv_monitor = KVMonitor(core.scheduler, core.lock).start()

    def ready(self) -> dict:
        """This actor's pid and pool size; raises EngineDeadError once the engine gave up on its ranks."""
        if self.engine.core.dead is not None:
            raise self.engine.core.dead
        return {"pid": os.getpid(), "num_kv_blocks": self.engine.core.num_kv_blocks}

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
    ):
        """Stream the request's outputs (deltas by default; several steps' deltas are merged into
        one item whenever the caller reads slower than the engine produces)."""
        async for output in self.engine.generate(prompt, params, request_id, cache_salt=cache_salt,
                                                 output_kind=output_kind):
            yield output

    async def generate_full(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                            cache_salt: str | None = None) -> RequestOutput:
        """The final output of a request, in one reply."""
        final = None
        async for output in self.engine.generate(prompt, params, request_id, cache_salt=cache_salt,
                                                 output_kind=RequestOutputKind.FINAL_ONLY):
            final = output
        return final

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None,
                          cache_salt: str | None, subscriber: str) -> None:
        """Admit a request whose deltas go to ``subscriber``'s stream. Raises ValueError for bad input
        and EngineOverloadedError when the waiting queue is full."""
        sub = self._subscribers.setdefault(subscriber, _Subscriber())
        done = asyncio.Event()

        def sink(item: RequestOutput | BaseException) -> None:
            sub.push(request_id, item)
            if isinstance(item, BaseException) or item.finished:
                done.set()
                self._finished.pop(request_id, None)

        self.engine.submit(request_id, prompt, params, sink, cache_salt=cache_salt)
        sub.request_ids.add(request_id)
        self._finished[request_id] = done

    async def subscribe(self, subscriber: str):
        """Stream ``subscriber``'s outputs: one list per engine step (more when the reader lags)."""
        sub = self._subscribers.setdefault(subscriber, _Subscriber())
        try:
            while True:
                await sub.ready.wait()
                sub.ready.clear()
                batch, sub.pending = sub.pending, []
                yield batch
        finally:  # the subscriber went away: nobody will read its requests' outputs
            for request_id in list(sub.request_ids):
                self.abort(request_id)
            self._subscribers.pop(subscriber, None)

    async def wait_finished(self, request_id: str) -> None:
        """Return when the request has ended (finished, aborted or failed)."""
        done = self._finished.get(request_id)
        if done is not None:
            await done.wait()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        if not self.engine.is_open(request_id):
            # it ended at once (it had not reached the engine, e.g. its grammar was compiling): no item
            # will come for it, so what waits on it (wait_finished, the LLMServer call) ends here
            done = self._finished.pop(request_id, None)
            if done is not None:
                done.set()
            for sub in self._subscribers.values():
                sub.request_ids.discard(request_id)

    def stats(self) -> dict:
        return self.engine.stats()

    async def kv_map(self) -> dict:
        """The KV-cache map of this engine (engine/kv_map.py): block states, counts, history, the most
        shared prefixes. Built on a thread (reused for a second: KVMonitor.min_interval_s): its
        encoding (tens of milliseconds for millions of blocks, outside the engine's lock) and a wait
        for the lock do not hold up the streams this actor's event loop serves."""
        return await asyncio.get_running_loop().run_in_executor(None, self.kv_monitor.snapshot)

    def routing_stats(self) -> dict:
        """What a prefix-aware router needs: the cached block hashes. (Load comes from Serve's own
        queue lengths; reporting it here would change the stats, and make Serve's controller
        rebroadcast them, every period.) The hashes come as a base and the changes since it
        (``engine/prefix_report.py``): only the changes since the last call are read under the
        engine's lock."""
        return {**self.engine.routing_report(), "block_size": self.config.cache.block_size}

    def placement(self) -> dict:
        """Placement group ids of this actor and of its ranks (tp > 1)."""
        executor = self.engine.core.executor
        ranks = [i["placement_group_id"] for i in executor.group.node_info] if hasattr(executor, "group") else []
        return {"scheduler": ray.get_runtime_context().get_placement_group_id(), "ranks": ranks}

    def worker_pids(self) -> list[int]:
        executor = self.engine.core.executor
        return executor.worker_pids() if hasattr(executor, "worker_pids") else [os.getpid()]

    @ray.method(enable_task_events=True)
    async def shutdown(self) -> None:
        self.kv_monitor.stop()
        await asyncio.get_running_loop().run_in_executor(None, self.engine.shutdown)


def launch_scheduler_actor(
    config: EngineConfig,
    *,
    placement_group=None,
    bundle_index: int = 0,
    first_rank_bundle: int | None = None,
    num_cpus: float = 1,
    num_gpus: float = 0,
    name: str | None = None,
    namespace: str | None = None,
    max_waiting_requests: int | None = None,
    torch_threads: int | None = None,
    cpu_share: float | None = None,
    bind_threads: bool = False,
    wait: bool = True,
    ready_timeout_s: float = 600.0,
    ranks: list | None = None,
):
    """Start a scheduler actor and (``wait``) block until it serves. In ``placement_group``, the actor
    takes bundle ``bundle_index`` and its ranks (tensor_parallel_size > 1) the bundles from
    ``first_rank_bundle`` on (default: the ones after the actor's); ``ranks``: rank actors the caller
    already created there (``cluster.worker_group.spawn_ranks``), which it then owns and kills."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from cluster.ray_env import ensure_ray

    ensure_ray(min_cpus=config.parallel.world_size + 2)
    options: dict = {"num_cpus": num_cpus, "num_gpus": num_gpus, "name": name, "namespace": namespace,
                     "max_concurrency": 10_000, "enable_task_events": task_events_enabled()}
    executor_kwargs = {}
    if placement_group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(placement_group, bundle_index)
        if config.parallel.world_size > 1:
            first = bundle_index + 1 if first_rank_bundle is None else first_rank_bundle
            executor_kwargs = {"placement_group": placement_group, "first_bundle": first, "ranks": ranks}
    actor = ray.remote(SchedulerActor).options(**options).remote(
        config, executor_kwargs=executor_kwargs, max_waiting_requests=max_waiting_requests,
        torch_threads=torch_threads, cpu_share=cpu_share, bind_threads=bind_threads)
    if not wait:
        return actor
    try:
        ray.get(actor.ready.remote(), timeout=ready_timeout_s)
    except BaseException:
        ray.kill(actor)
        raise
    return actor
