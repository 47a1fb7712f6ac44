"""The in-process executor: one rank (tensor_parallel_size=1) in the engine's own process."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.executor import Executor
from engine.messages import ModelRunnerOutput, SchedulerOutput
from workers.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, **placement) -> None:
        """``placement`` (a Ray placement group for remote executors) does not apply in-process."""
        if config.parallel.tensor_parallel_size != 1:
            raise ValueError("the in-process executor runs tensor_parallel_size=1 only")
        self.worker = Worker(config)
        self.worker.init_device()
        self.worker.load_model()

    def determine_num_kv_blocks(self) -> int:
        return self.worker.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def kv_cache_info(self) -> dict:
        return self.worker.kv_cache_info()

    def shutdown(self) -> None:
        self.worker.shutdown()
