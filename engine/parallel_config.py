"""ParallelConfig (ranks, stages, dispatch) and its pipeline checks: stage layers, layer splits, steps in flight."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import ModelConfig

PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
TP_DISPATCH = ("remote", "compiled")
# the architectures whose models run a stage of the layers (``pipeline_parallel_size`` > 1)
PIPELINE_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                    "Phi3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM", "OPTForCausalLM",
                                    "Gemma2ForCausalLM", "Gemma3ForCausalLM"})


@dataclass(frozen=True)
class ParallelConfig:
    """``tp_dispatch``: how each step reaches the Ray ranks, "remote" (one actor call per rank) or
    "compiled" (a Ray Compiled Graph over shared-memory channels)."""

    tensor_parallel_size: int = 1
    placement_strategy: str = "STRICT_PACK"
    tp_dispatch: str = "remote"
    # mixture-of-experts models: whole experts per rank (split as evenly as they go) instead of every
    # expert's intermediate features split across the ranks (vLLM's name)
    enable_expert_parallel: bool = False
    # the layers in that many contiguous stages, each a tensor-parallel group of ranks (``stage_layers``);
    # ``pipeline_layer_split``: the layers of each stage, instead of as even as they go
    pipeline_parallel_size: int = 1
    pipeline_layer_split: tuple[int, ...] | None = None
    # steps in flight at once under pipeline parallelism (None: one per stage, each stage busy with its own)
    batches_in_flight: int | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if isinstance(self.pipeline_parallel_size, bool) or not isinstance(self.pipeline_parallel_size, int) \
                or self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be an integer >= 1, got {self.pipeline_parallel_size!r}")
        if self.batches_in_flight is not None and (isinstance(self.batches_in_flight, bool) or not isinstance(
                self.batches_in_flight, int) or self.batches_in_flight < 1):
            raise ValueError(f"batches_in_flight must be an integer >= 1, got {self.batches_in_flight!r}")
        split = self.pipeline_layer_split
        if split is not None:
            if isinstance(split, list):
                object.__setattr__(self, "pipeline_layer_split", split := tuple(split))
            if not isinstance(split, tuple) or len(split) != self.pipeline_parallel_size or not all(
                    isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in split):
                raise ValueError(f"pipeline_layer_split must give a layer count >= 1 for each of the "
                                 f"{self.pipeline_parallel_size} pipeline stages, got {split!r}")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"placement_strategy must be one of {PLACEMENT_STRATEGIES}")
        if self.tp_dispatch not in TP_DISPATCH:
            raise ValueError(f"tp_dispatch must be one of {TP_DISPATCH}, got {self.tp_dispatch!r}")

    @property
    def world_size(self) -> int:
        """Ranks of one engine: ``pipeline_parallel_size`` stages of ``tensor_parallel_size``."""
        return self.pipeline_parallel_size * self.tensor_parallel_size

    @property
    def steps_in_flight(self) -> int:
        """Steps the engine keeps out at once: ``batches_in_flight``, by default one per pipeline stage
        (each stage busy with a step of its own); one without pipeline parallelism."""
        if self.pipeline_parallel_size == 1:
            return 1
        return self.batches_in_flight or self.pipeline_parallel_size

    def stage_layers(self, num_layers: int) -> list[tuple[int, int]]:
        """Each stage's layers [start, end): ``pipeline_layer_split``, else as even as they go, the
        first stages taking one more where the count does not divide (the last one also runs the
        final norm and the LM head)."""
        pp = self.pipeline_parallel_size
        if self.pipeline_layer_split is not None:
            counts = list(self.pipeline_layer_split)
            if sum(counts) != num_layers:
                raise ValueError(f"pipeline_layer_split {list(counts)} gives {sum(counts)} layers; the model has "
                                 f"{num_layers}")
        else:
            if num_layers < pp:
                raise ValueError(f"pipeline_parallel_size {pp} is more stages than the model's {num_layers} layers")
            counts = [num_layers // pp + (s < num_layers % pp) for s in range(pp)]
        starts = [sum(counts[:s]) for s in range(pp)]
        return [(start, start + n) for start, n in zip(starts, counts)]


def check_pipeline(parallel: ParallelConfig, model: ModelConfig) -> None:
    """The pipeline settings against the model (``EngineConfig``'s check): the layer split fits its
    layers, its architecture runs in stages, and steps in flight need stages. Any KV layout runs in
    stages (a hybrid one too: each stage's pool holds the pairs its layers use, ``KVLayout.pool_pairs``)."""
    if parallel.pipeline_parallel_size > 1:
        pp = parallel.pipeline_parallel_size
        parallel.stage_layers(model.hf_config["num_hidden_layers"])  # raises for a split that does not fit
        if model.architecture not in PIPELINE_ARCHITECTURES:
            raise ValueError(f"pipeline_parallel_size {pp} is not supported for {model.architecture} (it is for "
                             f"{', '.join(sorted(PIPELINE_ARCHITECTURES))})")
    elif parallel.pipeline_layer_split is not None:
        parallel.stage_layers(model.hf_config["num_hidden_layers"])  # one stage: every layer
    if (parallel.batches_in_flight or 1) > 1 and parallel.pipeline_parallel_size == 1:
        raise ValueError(f"batches_in_flight={parallel.batches_in_flight} needs pipeline_parallel_size > 1 "
                         f"(a step in flight per pipeline stage)")
