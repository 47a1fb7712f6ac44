"""The Ray actor around one tensor-parallel rank (``workers.worker.Worker``): a thin wrapper.

torch and the worker are imported when the actor starts, not with this module, so a process that
only creates ranks (a Serve replica, ``cluster.worker_group.spawn_ranks``) does not import them."""

from __future__ import annotations

import logging
import os
import socket

import ray

from engine.config import EngineConfig
from engine.executor import RankRaised
from engine.messages import ModelRunnerOutput, SchedulerOutput
from workers.model_source import localize

logger = logging.getLogger(__name__)


def rendezvous_address() -> str:
    """A torch.distributed init address from inside a Ray actor: this node's IP and a port free right now."""
    ip = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return f"tcp://{ip}:{s.getsockname()[1]}"


class WorkerActor:
    def __init__(self, config: EngineConfig, rank: int) -> None:
        self.config = localize(config)  # the checkpoint's copy on this node
        self.rank = rank
        self.worker = None  # a workers.worker.Worker once started
        import torch

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
        torch.set_num_threads(max(1, int(cpus)))  # Ray pins OMP_NUM_THREADS=1 in actors

    def node_info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {"rank": self.rank, "pid": os.getpid(), "node_id": ctx.get_node_id(),
                "ip": ray.util.get_node_ip_address(), "gpu_ids": ray.get_gpu_ids(),
                "placement_group_id": ctx.get_placement_group_id()}

    def rendezvous_address(self) -> str:
        """Rank 0 picks the process group's address (``rendezvous_address``)."""
        return rendezvous_address()

    def start(self, init_method: str) -> None:
        from workers.worker import Worker

        self.worker = Worker(self.config, self.rank, init_method)
        self.worker.init_device()
        self.worker.load_model()

    def determine_num_kv_blocks(self) -> int:
        return self.worker.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput | bytes) -> ModelRunnerOutput | None:
        """One step; the plan comes pickled from ``WorkerGroup.submit`` (``Worker.execute_model`` says why)."""
        return self.worker.execute_model(scheduler_output)

    def execute_model_in_graph(self, scheduler_output: SchedulerOutput | bytes) -> ModelRunnerOutput | RankRaised | None:
        """``execute_model`` in the compiled graph: what the step raised is the rank's answer, so that the
        driver reads every rank's and names the earliest stage's error (``WorkerGroup._get_compiled``)."""
        try:
            return self.worker.execute_model(scheduler_output)
        except Exception as exc:  # noqa: BLE001 - the driver fails the step with it
            # (the driver gets its type and first line; the traceback stays in this rank's log)
            logger.warning("rank %d: the step raised %s", self.rank, type(exc).__name__, exc_info=True)
            return RankRaised.of(exc)

    def kv_cache_info(self) -> dict:
        return self.worker.kv_cache_info()

    @ray.method(enable_task_events=True)  # rare; the per-step calls record none (worker_group.py)
    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
