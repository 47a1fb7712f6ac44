"""Engine settings: frozen, validated once, shared by the scheduler and (pickled) by every rank."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from engine.kv_layout import KVLayout
# ParallelConfig and its pipeline checks live in engine.parallel_config; re-exported here
from engine.parallel_config import (PIPELINE_ARCHITECTURES, PLACEMENT_STRATEGIES, TP_DISPATCH,  # noqa: F401
                                    ParallelConfig, check_pipeline)

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")  # as kernels.kv_quant names them
# the deepest nesting a structured-output constraint may be allowed (the API refuses deeper ones before
# reading them into the engine's request)
STRUCTURED_OUTPUT_DEPTH_CEILING = 256


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


# architectures whose sliding-window layers the kernels implement (a window per layer): their contexts
# are not capped to the window
WINDOWED_ARCHITECTURES = frozenset({"Gemma2ForCausalLM", "Gemma3ForCausalLM"})
# the Llama-family models, whose runner offsets long prompts' positions into LongRoPE's long factors
# (``RotaryEmbedding.long_rope``); a LongRoPE config on any other architecture is refused
LONG_ROPE_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                     "Qwen3ForCausalLM", "Phi3ForCausalLM"})


def sliding_window(hf_config: dict) -> int | None:
    """The attention window if any layer uses one (Mistral, Qwen2 with sliding layers, Gemma 2/3), else None."""
    window = hf_config.get("sliding_window")
    layer_types = hf_config.get("layer_types")
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    return window if hf_config.get("use_sliding_window", True) else None


def num_experts(hf_config: dict) -> int:
    """The experts of a mixture-of-experts config (Mixtral's ``num_local_experts``, Qwen3-MoE's
    ``num_experts``), 0 for a dense model."""
    return int(hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0)


def long_rope_threshold(hf_config: dict) -> int | None:
    """Under LongRoPE (Phi-3's ``longrope``; ``su``, and ``yarn`` in a phi3 config, are its old names) the
    original context length: a prompt longer than it is rotated with the long factors at every position,
    a shorter one with the short factors below it, so the two hash apart in the prefix cache (their KV
    differs at the same tokens). None for every other model."""
    params = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type"))
    if rope_type in ("longrope", "su") or (rope_type == "yarn" and hf_config.get("model_type") == "phi3"):
        # as ``workers.layers.rope_parameters`` reads it (transformers' ``standardize_rope_params``): a top-level
        # value wins, else the rope settings', else max_position_embeddings
        return (hf_config.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                or hf_config.get("max_position_embeddings"))
    return None


def _uses_long_rope(hf_config: dict) -> bool:
    """Whether any rope settings of the config (per layer type too, as Gemma 3's) are LongRoPE."""
    params = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    nested = [p for p in params.values() if isinstance(p, dict)]
    return long_rope_threshold(hf_config) is not None or any(
        p.get("rope_type", p.get("type")) in ("longrope", "su") for p in nested)


def _as_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


@dataclass(frozen=True)
class ModelConfig:
    """A Hugging Face model directory, read from its config.json and generation_config.json.

    ``source`` is the Hugging Face repo id (and ``revision``) the directory came from, if any: a process on
    another node finds its own copy by it (``workers.model_source.localize``)."""

    path: str
    hf_config: dict = field(repr=False, hash=False, compare=False)
    architecture: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    dtype: str = "auto"
    source: str | None = None
    revision: str | None = None

    @property
    def long_rope_threshold(self) -> int | None:
        return long_rope_threshold(self.hf_config)

    @classmethod
    def from_dir(cls, path: str | Path, dtype: str = "auto", max_model_len: int | None = None,
                 source: str | None = None, revision: str | None = None) -> ModelConfig:
        root = Path(path)
        if not (root / "config.json").exists():
            raise ValueError(f"{root} is not a model directory: it has no config.json")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        hf_config = _read_json(root / "config.json")
        architectures = hf_config.get("architectures") or []
        if not architectures:
            raise ValueError(f"{root}/config.json names no architectures")
        if _uses_long_rope(hf_config) and architectures[0] not in LONG_ROPE_ARCHITECTURES:
            raise ValueError(f"{architectures[0]} cannot serve LongRoPE (longrope rope settings): only "
                             f"{', '.join(sorted(LONG_ROPE_ARCHITECTURES))} rotate long prompts with its long factors")
        max_positions = int(hf_config.get("max_position_embeddings") or hf_config.get("n_positions") or 2048)
        # Mistral and Qwen2 attend fully here, so their contexts stay within the window; the windows of
        # WINDOWED_ARCHITECTURES are the kernels' (per layer)
        window = None if WINDOWED_ARCHITECTURES & set(architectures) else sliding_window(hf_config)
        limit = min(max_positions, window) if window else max_positions
        if max_model_len is None:
            max_model_len = limit
        elif not 1 <= max_model_len <= limit:
            why = f"the sliding window of {window}" if window and window < max_positions else \
                f"max_position_embeddings={max_positions}"
            raise ValueError(f"max_model_len={max_model_len} must be between 1 and {limit} ({why})")
        generation = _read_json(root / "generation_config.json")
        eos = _as_ids(generation.get("eos_token_id", hf_config.get("eos_token_id")))
        return cls(
            path=str(root),
            hf_config=hf_config,
            architecture=architectures[0],
            max_model_len=max_model_len,
            vocab_size=int(hf_config["vocab_size"]),
            eos_token_ids=eos,
            dtype=dtype,
            source=source,
            revision=revision,
        )


# a CPU rank's KV pool when no size is given: this many bytes or a quarter of the memory free at its start,
# whichever is less, and at most this many blocks (a pool beyond it only grows the prefix cache, at Python
# cost); what each rank reserves from Ray's ``memory`` (cluster.memory_plan.default_kv_bytes)
CPU_DEFAULT_KV_BYTES = 2 << 30
CPU_DEFAULT_MAX_BLOCKS = 32768
# EngineConfig.cpu_matmul_precision's values
CPU_MATMUL_PRECISIONS = ("highest", "high")


@dataclass(frozen=True)
class CacheConfig:
    """KV pool size: ``num_kv_blocks`` if given, else ``kv_cache_memory_bytes`` per rank, else (CUDA)
    ``gpu_memory_utilization`` of the device after profiling a forward pass.

    The host KV tier (off by default; needs prefix caching): ``num_host_kv_blocks`` blocks if given,
    else ``kv_offload_bytes`` of host memory per rank."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_host_kv_blocks: int = 0
    kv_offload_bytes: int | None = None
    # models with sliding-window and full-attention layers (Gemma 2 / 3): True keeps every layer's
    # blocks as a full layer's, instead of releasing the window layers' blocks behind their window
    # (``engine.kv_layout``; vLLM's name). The host tier keeps every layer's blocks whole.
    disable_hybrid_kv_cache_manager: bool = False
    # the KV pool's element format: "auto" (the model's dtype), or quantized codes with a scale per
    # token and KV head: "fp8" / "fp8_e4m3", "fp8_e5m2", "int8" (``kernels.kv_quant``; vLLM's names)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be between 1 and 1024, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (block 0 is reserved), got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if isinstance(self.num_host_kv_blocks, bool) or not isinstance(self.num_host_kv_blocks, int) \
                or self.num_host_kv_blocks < 0:
            raise ValueError(f"num_host_kv_blocks must be an integer >= 0, got {self.num_host_kv_blocks!r}")
        if self.kv_offload_bytes is not None and self.kv_offload_bytes < 0:
            raise ValueError(f"kv_offload_bytes must be >= 0, got {self.kv_offload_bytes}")
        if (self.num_host_kv_blocks or self.kv_offload_bytes) and not self.enable_prefix_caching:
            raise ValueError("the host KV tier (num_host_kv_blocks, kv_offload_bytes) needs enable_prefix_caching")

    def host_kv_blocks_for(self, bytes_per_block: int) -> int:
        """Blocks of the host KV tier on every rank (0: no tier)."""
        if self.num_host_kv_blocks:
            return self.num_host_kv_blocks
        return (self.kv_offload_bytes or 0) // bytes_per_block


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    device: str = "auto"  # "auto" (CUDA when available), "cpu" or "cuda"
    seed: int = 0
    # "auto": the compiled CPU kernels on a CPU device when they build here, else plain torch
    attention_backend: str = "auto"
    # attend once per step to leading blocks that running requests share (backends that support it)
    cascade_attention: bool = True
    # batch-invariant serving: a greedy request's tokens and logprobs are the same to the bit whatever
    # shares its batch, the chunk budget, a prefix-cache hit or a preemption (the compiled CPU kernels)
    deterministic: bool = False
    # the compiled CPU kernels' float32 linear layers and MoE experts: "highest", one float32 multiply-add chain per
    # element; "high", where the CPU has AMX-BF16, weights split into bfloat16 hi and lo halves (~16 bits
    # of each mantissa): steps of 64 rows and more as three bfloat16 products on AMX tiles with float32
    # sums (torch's float32 matmul precision "high"), fewer rows as float32 products against hi + lo;
    # elsewhere as "highest". Deterministic mode keeps the float32 chain.
    cpu_matmul_precision: str = "highest"
    # True: every step runs eagerly. False: on CUDA with the triton attention backend, decode-only steps
    # replay CUDA graphs captured at start (``workers.cuda_graphs``). True by default until the capture
    # has run on a GPU.
    enforce_eager: bool = True
    # lost ranks are rebuilt at most this many times within the window (then the engine is dead);
    # each rebuild after the first in the window waits restart_backoff_s, doubling
    max_worker_restarts: int = 3
    worker_restart_window_s: float = 600.0
    worker_restart_backoff_s: float = 1.0
    # this many steps failing in a row (none succeeding between), each holding one different request:
    # the ranks are broken (a sticky device fault), not a request, and are rebuilt within the same budget
    max_consecutive_failed_steps: int = 3
    # what one request may ask for (its work is bounded by these): samples, logprobs per token (and
    # per prompt token: prompt_logprobs; 20 as vLLM's default, raisable), stop strings, the characters
    # of one stop string and of all of them, and stop token ids
    max_n: int = 128
    max_logprobs: int = 20
    max_stop_sequences: int = 64
    max_stop_string_length: int = 1024
    max_stop_total_length: int = 16384
    max_stop_token_ids: int = 1024
    # prompt_logprobs' entries of one request, prompt tokens x (k + 1) x n (computed once, but a
    # completion response repeats them in each of its n choices): they are held on the scheduler,
    # travel as one object and are rendered on the Ingress's event loop. 100k entries are about 7 MB of
    # JSON and well under a second to render: a 4761-token prompt at k = 20, a 100k-token one at k = 0
    max_prompt_logprobs_entries: int = 100_000
    # what one structured-output constraint may ask the grammar compiler for (engine/structured_bounds.py):
    # characters of its text, nesting levels (at most STRUCTURED_OUTPUT_DEPTH_CEILING), count keywords and
    # {n,m} repetitions; a compile's time (its request fails past it), compiles queued or running at once
    # (more are refused as overload), and the threads that run them
    structured_output_max_length: int = 65536
    structured_output_max_depth: int = 64
    structured_output_max_count: int = 4096
    structured_output_compile_timeout_s: float = 10.0
    structured_output_max_pending_compiles: int = 64
    structured_output_compile_threads: int = 2

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.cpu_matmul_precision not in CPU_MATMUL_PRECISIONS:
            raise ValueError(f"cpu_matmul_precision must be one of {', '.join(CPU_MATMUL_PRECISIONS)}, got "
                             f"{self.cpu_matmul_precision!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.deterministic and self.attention_backend == "torch":
            raise ValueError("deterministic=True needs attention_backend 'cpu', 'triton' or 'auto', not 'torch'")
        if self.deterministic and self.parallel.tensor_parallel_size > 2:
            # two ranks' partial sums add alike in either order; more are summed in an order the
            # collective picks from the message size, which the batch sets
            raise ValueError(f"deterministic=True runs at tensor_parallel_size 1 or 2, not "
                             f"{self.parallel.tensor_parallel_size}: the all-reduce of more ranks sums in an order "
                             f"that depends on the batch")
        if self.parallel.enable_expert_parallel:
            self._check_expert_parallel()
        check_pipeline(self.parallel, self.model)
        if self.max_worker_restarts < 0:
            raise ValueError(f"max_worker_restarts must be >= 0, got {self.max_worker_restarts}")
        if not isinstance(self.max_consecutive_failed_steps, int) or self.max_consecutive_failed_steps < 2:
            raise ValueError(f"max_consecutive_failed_steps must be an integer >= 2, got "
                             f"{self.max_consecutive_failed_steps!r}")
        for name in ("max_n", "max_logprobs", "max_stop_sequences", "max_stop_string_length", "max_stop_total_length",
                     "max_stop_token_ids", "max_prompt_logprobs_entries"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "max_logprobs" else 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("structured_output_max_length", "structured_output_max_count",
                     "structured_output_max_pending_compiles", "structured_output_compile_threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 1 <= self.structured_output_max_depth <= STRUCTURED_OUTPUT_DEPTH_CEILING:
            raise ValueError(f"structured_output_max_depth must be between 1 and {STRUCTURED_OUTPUT_DEPTH_CEILING}, "
                             f"got {self.structured_output_max_depth!r}")
        if not self.structured_output_compile_timeout_s > 0:
            raise ValueError(f"structured_output_compile_timeout_s must be > 0, got "
                             f"{self.structured_output_compile_timeout_s!r}")
        if not self.worker_restart_window_s > 0 or not self.worker_restart_backoff_s >= 0:
            raise ValueError("worker_restart_window_s must be > 0 and worker_restart_backoff_s >= 0")

    def _check_expert_parallel(self) -> None:
        tp, cfg = self.parallel.tensor_parallel_size, self.model.hf_config
        experts = num_experts(cfg)
        if tp < 2:
            raise ValueError("enable_expert_parallel places experts across tensor-parallel ranks: it needs "
                             "tensor_parallel_size 2 or more, not 1")
        if not experts:
            raise ValueError(f"enable_expert_parallel needs a mixture-of-experts model; {self.model.architecture} "
                             f"has no experts")
        if experts < tp:
            raise ValueError(f"enable_expert_parallel places whole experts on ranks: {experts} experts cannot "
                             f"cover {tp} ranks")

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    @property
    def uses_host_tier(self) -> bool:
        return bool(self.cache.num_host_kv_blocks or self.cache.kv_offload_bytes)

    def kv_layout(self) -> KVLayout:
        """Which layers' KV each block id holds (``engine.kv_layout``): hybrid for models with window
        layers unless ``disable_hybrid_kv_cache_manager`` or the host tier (which keeps blocks whole)."""
        hybrid = not self.cache.disable_hybrid_kv_cache_manager and not self.uses_host_tier
        return KVLayout.for_model(self.model.hf_config, self.model.architecture, hybrid, self.max_model_len)
