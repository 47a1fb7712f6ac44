"""The scheduler actor: one per engine instance. It owns the scheduler, the block tables and the
prefix cache, runs the step loop, and drives its tensor-parallel worker group.

    caller ──generate(id, prompt, params)──► SchedulerActor ──SchedulerOutput──► WorkerActor × tp
           ◄──── RequestOutput deltas ─────  (AsyncLLM: EngineCore + RayExecutor)
           ──abort(id)────────────────────►

``generate`` is a streaming actor method: callers iterate the ObjectRefGenerator it returns.
Cancelling that generator (or calling ``abort``) ends the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import os

from engine.async_engine import AsyncLLM
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.executor import create_executor
from engine.messages import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams


class SchedulerActor:
    def __init__(self, config: EngineConfig, executor: str | None = None) -> None:
        self.config = config
        self.engine = AsyncLLM(config, core=EngineCore(config, create_executor(config, executor)))

    def ready(self) -> dict:
        return {"pid": os.getpid(), "num_kv_blocks": self.engine.core.num_kv_blocks}

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
    ):
        """Stream the request's outputs (deltas by default)."""
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

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def stats(self) -> dict:
        return self.engine.stats()

    def worker_pids(self) -> list[int]:
        executor = self.engine.core.executor
        return executor.worker_pids() if hasattr(executor, "worker_pids") else [os.getpid()]

    async def shutdown(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.engine.shutdown)


def launch_scheduler_actor(config: EngineConfig, *, num_cpus: float = 1, name: str | None = None,
                           executor: str | None = None, ready_timeout_s: float = 600.0):
    """Start a scheduler actor (and through it the worker group) and wait until it serves."""
    import ray

    from cluster.ray_env import ensure_ray

    ensure_ray(min_cpus=config.parallel.tensor_parallel_size + 2)
    actor = ray.remote(SchedulerActor).options(num_cpus=num_cpus, name=name, max_concurrency=1000).remote(
        config, executor)
    ray.get(actor.ready.remote(), timeout=ready_timeout_s)
    return actor
