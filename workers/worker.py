"""One tensor-parallel rank: device, process group, model shard, KV pool shard.

A plain class: the in-process executor holds one directly, and the Ray worker actor (``cluster/``)
is a thin wrapper around it.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle

import torch
import torch.distributed as dist

from engine.config import CPU_DEFAULT_KV_BYTES, CPU_DEFAULT_MAX_BLOCKS, EngineConfig
from engine.messages import ModelRunnerOutput, SchedulerOutput
from workers.allocator import tune_malloc
from workers.cuda_graphs import graph_memory_reserve
from workers.kv_pool import HostKVTier
from workers.model_runner import ModelRunner
from workers.parallel_state import PipelineStage, TPGroup

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for, but torch sees no CUDA device")
    return torch.device(device)


def resolve_dtype(dtype: str, hf_config: dict, device: torch.device) -> torch.dtype:
    """``auto``: float32 on CPU (fast there, and exact against the reference); on CUDA the
    checkpoint's half type, or bfloat16 for a float32 checkpoint."""
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cpu":
        return torch.float32
    configured = hf_config.get("torch_dtype") or hf_config.get("dtype")
    if configured in ("bfloat16", "float16"):
        return getattr(torch, configured)
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, distributed_init_method: str | None = None) -> None:
        self.config = config
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.model.dtype, config.model.hf_config, self.device)
        self.tp = TPGroup()
        self.stage: PipelineStage | None = None  # under pipeline parallelism: this rank's stage
        self.runner: ModelRunner | None = None
        self.host_tier: HostKVTier | None = None
        self._memory_at_start: tuple[int, int] | None = None  # CUDA (free, total) before loading
        # CUDA: what the KV budget took off (the graphs' share measured before), and what the graphs took
        self.memory_profile: dict[str, int] = {}

    def init_device(self) -> None:
        if self.device.type == "cpu":
            tune_malloc()
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
            torch.cuda.empty_cache()
            self._memory_at_start = torch.cuda.mem_get_info(self.device)
        parallel = self.config.parallel
        tp_size, pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        if parallel.world_size > 1:
            dist.init_process_group(
                backend="nccl" if self.device.type == "cuda" else "gloo",
                init_method=self.distributed_init_method, rank=self.rank, world_size=parallel.world_size,
                timeout=datetime.timedelta(seconds=float(os.environ.get("KVSERVE_DIST_TIMEOUT_S", "120"))),
            )
        # global rank = stage * tp + tensor-parallel index: a stage's ranks are consecutive
        pp_rank, tp_rank = divmod(self.rank, tp_size)
        if tp_size > 1 and pp_size == 1:
            self.tp = TPGroup(tp_rank, tp_size, dist.group.WORLD)
        elif tp_size > 1:  # every rank makes every stage's group, in the same order
            groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) for s in range(pp_size)]
            self.tp = TPGroup(tp_rank, tp_size, groups[pp_rank])
        if pp_size > 1:
            num_layers = self.config.model.hf_config["num_hidden_layers"]
            start, end = parallel.stage_layers(num_layers)[pp_rank]
            # the stages' message headers go over gloo where the activations go over NCCL (every rank makes
            # the group): reading a header then waits for the previous stage's host, not for its device
            headers = dist.new_group(backend="gloo") if self.device.type == "cuda" else None
            self.stage = PipelineStage(pp_rank, pp_size, start, end, num_layers,
                                       prev=self.rank - tp_size if pp_rank > 0 else None,
                                       next=self.rank + tp_size if pp_rank < pp_size - 1 else None,
                                       header_group=headers)
        torch.manual_seed(self.config.seed)

    def load_model(self) -> None:
        self.runner = ModelRunner(self.config, self.tp, self.device, self.dtype, self.stage)

    def determine_num_kv_blocks(self) -> int:
        """Blocks this rank's pool can hold: from ``kv_cache_memory_bytes``, else on CUDA from
        ``gpu_memory_utilization`` after a profiling forward and, where CUDA graphs will be captured, a
        capture over a throwaway pool (their memory is left out of the pool), else the CPU default."""
        cache = self.config.cache
        spec = self.runner.kv_spec
        if cache.kv_cache_memory_bytes is not None:
            return spec.num_blocks_for(cache.kv_cache_memory_bytes)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.runner.profile_run()
            self.runner.profile_decode()
            torch.cuda.synchronize(self.device)
            free_at_start, total = self._memory_at_start
            used_by_others = total - free_at_start
            peak = torch.cuda.max_memory_allocated(self.device)
            # memory this process holds that torch's allocator did not hand out: NCCL's buffers, the
            # CUDA libraries' workspaces (measured after the profile, which created them)
            free_now, _ = torch.cuda.mem_get_info(self.device)
            outside_torch = max(0, total - free_now - used_by_others - torch.cuda.memory_reserved(self.device))
            graphs = self.runner.measure_graph_memory()  # None where no graphs will be captured
            graphs_reserve = graph_memory_reserve(graphs) if graphs is not None else 0
            budget = int(total * cache.gpu_memory_utilization) - used_by_others - peak - outside_torch - graphs_reserve
            self.memory_profile = {"used_by_others": used_by_others, "peak": peak, "outside_torch": outside_torch,
                                   "kv_budget": budget}
            if graphs is not None:
                self.memory_profile["cuda_graphs_reserved"] = graphs_reserve
            if budget < 2 * spec.bytes_per_block:
                raise ValueError(
                    f"no memory left for the KV cache: {total / 2**30:.1f} GiB x gpu_memory_utilization "
                    f"{cache.gpu_memory_utilization} minus {used_by_others / 2**30:.1f} GiB used elsewhere "
                    f"minus a peak of {peak / 2**30:.1f} GiB for weights and activations minus "
                    f"{outside_torch / 2**30:.1f} GiB outside torch's allocator"
                    + (f" minus {graphs_reserve / 2**30:.1f} GiB for CUDA graphs" if graphs is not None else "")
                )
            return spec.num_blocks_for(budget)
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        budget = min(CPU_DEFAULT_KV_BYTES, free // 4)
        return min(spec.num_blocks_for(budget), CPU_DEFAULT_MAX_BLOCKS)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)
        self.num_kv_blocks = num_blocks
        num_host = self.config.cache.host_kv_blocks_for(self._largest_stage_block_bytes())
        if num_host and self.runner.layout.hybrid:  # (EngineConfig.kv_layout keeps blocks whole with a host tier)
            raise ValueError("the host KV tier needs every layer's KV in a block: not a hybrid KV layout")
        self.host_tier = HostKVTier(self.runner.kv_spec, num_host, self.device) if num_host else None
        if self.device.type == "cpu" and not self.runner.attention_backend.interpreted:
            self.runner.warm_up()  # (an interpreted backend is for tests: nothing to warm)
        # where they can run and enforce_eager=False (a log line says), within what the KV budget left them
        self.runner.capture_graphs(budget=self.memory_profile.get("cuda_graphs_reserved"))
        if self.runner.graphs is not None:
            self.memory_profile["cuda_graphs"] = self.runner.graphs.memory_bytes

    def _largest_stage_block_bytes(self) -> int:
        """Bytes of one block on this rank, or under pipeline parallelism on a rank of the stage with
        the most layers: every rank then gets the same host tier slots from ``kv_offload_bytes``."""
        spec, stage = self.runner.kv_spec, self.stage
        if stage is None:
            return spec.bytes_per_block
        layout = self.runner.layout  # a stage's pool: the tensor pairs its layers use (KVLayout.pool_pairs)
        largest = max(len(layout.pool_pairs(start, end))
                      for start, end in self.config.parallel.stage_layers(stage.num_layers))
        return spec.bytes_per_block // spec.num_layers * largest

    def execute_model(self, scheduler_output: SchedulerOutput | bytes) -> ModelRunnerOutput | None:
        """One step. Under pipeline parallelism every step exchanges exactly one message on each link
        between stages, whatever happens (``PipelineStage``): a stage that fails the step before its
        receive still reads the previous stage's message, and one that fails it before handing its
        activations over tells the next stage so, which raises ``UpstreamStageFailed`` in turn. No rank
        waits for activations that never come, and the links stay in step for the steps after.
        A rank actor gets the plan pickled (``WorkerGroup.submit``) and it is unpickled here, inside the
        step: a plan one rank cannot read fails the step like any other error, with the links in step
        (read by Ray before the call, it failed the call before this protocol ran, and a later stage
        waited for activations until gloo's timeout)."""
        stage = self.runner.stage
        if stage.size == 1:
            return self._step(scheduler_output)
        self.runner.received, self.runner.handed_over = stage.is_first, False
        try:
            return self._step(scheduler_output)
        except BaseException:
            # (a failure inside a receive or a send has broken that link: nothing more goes over it.)
            # Each repair is tried on its own, and the step's own error is the one raised.
            if not self.runner.received:
                try:
                    stage.drain(self.dtype, self.device)
                except Exception:  # noqa: BLE001 - the link from the previous stage is broken
                    logger.exception("pipeline stage %d could not read the previous stage's message", stage.rank)
            if not stage.is_last and not self.runner.handed_over:
                try:
                    stage.send_failure()
                except Exception:  # noqa: BLE001 - the link to the next stage is broken
                    logger.exception("pipeline stage %d could not tell the next stage of its failure", stage.rank)
            raise

    def _step(self, scheduler_output: SchedulerOutput | bytes) -> ModelRunnerOutput | None:
        if isinstance(scheduler_output, bytes):
            scheduler_output = pickle.loads(scheduler_output)
        if scheduler_output.kv_offloads or scheduler_output.kv_restores:
            self.run_tier_copies(scheduler_output.kv_offloads, scheduler_output.kv_restores)
        return self.runner.execute_model(scheduler_output)

    def run_tier_copies(self, offloads: list[tuple[int, int]], restores: list[tuple[int, int]]) -> None:
        """The step's host-tier copies, before its forward: offloads first (an evicted block may be
        rewritten in this step), then restores (a block offloaded in this step may come back in it)."""
        if self.host_tier is None:
            raise RuntimeError("the step carries host KV tier copies, but this rank has no host tier")
        self.host_tier.offload(self.runner.kv_pool, offloads)
        self.host_tier.restore(self.runner.kv_pool, restores)  # on the stream the forward then uses

    def kv_cache_info(self) -> dict:
        spec = self.runner.kv_spec
        return {
            "kv_bytes_per_block_per_rank": spec.bytes_per_block,
            "kv_cache_dtype": spec.kv_format,  # "auto" (the model's dtype) or the quantized format
            "kv_pool_bytes_per_rank": spec.bytes_per_block * getattr(self, "num_kv_blocks", 0),
            "num_host_kv_blocks": self.host_tier.num_slots if self.host_tier is not None else 0,
            "host_kv_bytes_per_rank": self.host_tier.num_bytes if self.host_tier is not None else 0,
            "kv_heads_per_rank": spec.num_kv_heads,
            "kv_heads_replicated": spec.kv_heads_replicated,
            "dtype": str(self.dtype).removeprefix("torch."),
            "attention_backend": self.runner.attention_backend.name,
            # the compiled CPU linear's products: "bf16x3" (cpu_matmul_precision "high" on AMX: the float32
            # layers whose input and output features 32 divides, MoE experts' weights whose inputs it divides)
            # or "float32"
            "cpu_matmul": self.runner.matmul,
            "device": str(self.device),
            # decode batch sizes that replay a CUDA graph (none: every step runs eagerly)
            "cuda_graph_sizes": list(self.runner.graphs.sizes) if self.runner.graphs is not None else [],
        }

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
