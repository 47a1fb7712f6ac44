"""The Ray executor: tensor-parallel ranks as Ray actors, rebuilt when one of them dies."""

from __future__ import annotations

import logging

from cluster.ray_env import ensure_ray
from cluster.worker_group import WorkerGroup
from engine.config import EngineConfig
from engine.executor import Executor
from engine.messages import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class RayExecutor(Executor):
    """``placement_group``/``first_bundle`` place the ranks in a group the caller owns (a Serve
    replica's); without them the executor reserves its own. ``ranks``: rank actors already started
    there (``spawn_ranks``) for the first group; a rebuilt group starts its own."""

    def __init__(self, config: EngineConfig, placement_group=None, first_bundle: int = 0, ranks: list | None = None) -> None:
        ensure_ray(min_cpus=config.parallel.world_size + 2)
        self.config = config
        self._placement = {"placement_group": placement_group, "first_bundle": first_bundle}
        self.group = WorkerGroup(config, **self._placement, actors=ranks)
        self.max_steps_in_flight = config.parallel.steps_in_flight
        self.num_blocks: int | None = None
        self.num_restarts = 0
        self._kv_cache_info: dict = {}

    def determine_num_kv_blocks(self) -> int:
        return self.group.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.group.initialize_kv_cache(num_blocks)
        self.num_blocks = num_blocks
        self._kv_cache_info = self._collect_kv_cache_info()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.group.execute_model(scheduler_output)

    def submit(self, scheduler_output: SchedulerOutput):
        return self.group.submit(scheduler_output)

    def collect(self, handle) -> ModelRunnerOutput:
        return self.group.collect(handle)

    def restart(self) -> None:
        """Replace the whole group (the survivors' KV is useless without the lost shard)."""
        logger.warning("rebuilding the tensor-parallel worker group")
        self.group.kill()
        self.group = WorkerGroup(self.config, **self._placement)
        self.initialize_kv_cache(self.num_blocks)
        self.num_restarts += 1

    def pipeline_times(self) -> dict:
        """Per pipeline stage since the group started: seconds computing and seconds waiting
        (``worker_group.PipelineTimes``)."""
        return self.group.pipeline.report()

    def worker_pids(self) -> list[int]:
        return self.group.pids()

    def _collect_kv_cache_info(self) -> dict:
        ranks = self.group.kv_cache_info()
        # per-rank figures of the rank with the most KV (under pipeline parallelism stages differ by their
        # layers; the by-rank list is exact)
        largest = max(ranks, key=lambda r: r["kv_bytes_per_block_per_rank"])
        return {**largest, "kv_pool_bytes_by_rank": [r["kv_pool_bytes_per_rank"] for r in ranks],
                "kv_bytes_per_block_all_ranks": sum(r["kv_bytes_per_block_per_rank"] for r in ranks),
                "worker_nodes": [info["node_id"] for info in self.group.node_info]}

    def kv_cache_info(self) -> dict:
        return self._kv_cache_info

    def shutdown(self) -> None:
        if self.group.actors:
            self.group.shutdown()
