"""How the engine reaches the ranks that run the model. The engine names executors, never imports
them at module level: ``engine`` stays free of torch and ray."""

from __future__ import annotations

import dataclasses
import importlib
from abc import ABC, abstractmethod

from engine.config import EngineConfig
from engine.messages import ModelRunnerOutput, SchedulerOutput

EXECUTORS = {
    "uniproc": "workers.executor:UniProcExecutor",  # one rank, in this process
    "ray": "cluster.executor:RayExecutor",  # tensor-parallel ranks as Ray actors
}


class WorkerFailedError(RuntimeError):
    """A rank died (or hangs): its state is lost; the executor may be able to ``restart``."""


class StepFailedError(RuntimeError):
    """A step raised inside a rank, and every rank is alive and answered: the ranks need no
    rebuild, the step is rolled back. ``kind`` names the exception the rank raised.
    ``ranks_stuck``: a pipeline stage raised before it could tell the later stages (which is where
    ``UpstreamStageFailed`` comes from), and they still wait for its activations: the ranks are sound but
    must be rebuilt (not held against the restart budget) before the next step."""

    def __init__(self, kind: str, message: str, ranks_stuck: bool = False) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.ranks_stuck = ranks_stuck


class UpstreamStageFailed(RuntimeError):
    """Raised by a pipeline stage whose previous stage failed the step before sending its activations
    (``workers.parallel_state.PipelineStage``): this stage ran none of the step's layers (its batch was
    prepared; earlier stages may have written their layers' KV, which the step's rollback leaves
    unregistered); that stage's error is the step's cause."""


@dataclasses.dataclass(frozen=True)
class RankRaised:
    """What a rank raised in a step, as the rank's answer (the compiled graph's ranks return it rather
    than raise: ``cluster.worker_actor.WorkerActor.execute_model_in_graph``): the exception's type and the
    first line of its message."""

    kind: str
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> RankRaised:
        lines = str(exc).strip().splitlines()
        return cls(type(exc).__name__, lines[0][:200] if lines else "")

    @property
    def upstream(self) -> bool:
        """An echo: an earlier pipeline stage failed the step (``UpstreamStageFailed``)."""
        return self.kind == UpstreamStageFailed.__name__

    def error(self, ranks_stuck: bool = False) -> StepFailedError:
        return StepFailedError(self.kind, self.message, ranks_stuck)


class Executor(ABC):
    """The ranks of one engine instance, driven one step at a time."""

    @abstractmethod
    def determine_num_kv_blocks(self) -> int:
        """How many KV blocks every rank can hold (the minimum over ranks)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV pool shard of every rank."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; rank 0's sampled tokens come back."""

    # how many steps may be in flight at once (``submit`` / ``collect``): more than one where the ranks
    # are pipeline stages, each then busy with a different step
    max_steps_in_flight = 1

    def submit(self, scheduler_output: SchedulerOutput):
        """Start a step without waiting for it; ``collect`` its handle, in submission order. By default
        the step runs here and now."""
        return self.execute_model(scheduler_output)

    def collect(self, handle) -> ModelRunnerOutput:
        """The output of a step ``submit`` started (raising what ``execute_model`` would)."""
        return handle

    def restart(self) -> None:
        """Replace lost ranks with fresh ones holding an empty pool of the same size."""
        raise WorkerFailedError(f"{type(self).__name__} cannot replace its ranks")

    def kv_cache_info(self) -> dict:
        """Pool geometry and bytes per rank (for stats and docs)."""
        return {}

    def shutdown(self) -> None:
        """Release the ranks."""


def executor_name(config: EngineConfig) -> str:
    return "uniproc" if config.parallel.world_size == 1 else "ray"


def create_executor(config: EngineConfig, name: str | None = None, **kwargs) -> Executor:
    """The executor ``name`` (by default the one ``tensor_parallel_size`` calls for); ``kwargs`` go to
    its constructor (placement for the Ray executor)."""
    target = EXECUTORS[name or executor_name(config)]
    module_name, class_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise RuntimeError(f"executor {target} is not available: {exc}") from exc
    return getattr(module, class_name)(config, **kwargs)
