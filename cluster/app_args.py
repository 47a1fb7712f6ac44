"""The application's arguments: what `serve run serve_app:app key=value ...` (or a Serve config's
`args`) may say, validated by pydantic, in the flat keys and in Ray Serve LLM's shapes (`engine_kwargs`,
`model_loading_config`, `deployment_config`, `ingress_deployment_config`); and where the API key comes
from (`api_key_env`, `api_key_file`). No Ray here: `serve_app.build_app` turns these into deployments."""

from __future__ import annotations

import json

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from api.tool_parsers import check_tool_parser


def api_key_from_file(path: str) -> str:
    """The API key held by the file ``path`` (``api_key_file``, e.g. a mounted Kubernetes Secret),
    without surrounding whitespace."""
    try:
        key = open(path, encoding="utf-8").read().strip()
    except OSError as exc:
        raise ValueError(f"api_key_file={path}: the file cannot be read on this node ({exc.strerror})") from None
    if not key:
        raise ValueError(f"api_key_file={path}: the file is empty")
    return key


def api_key_from_env(name: str) -> str:
    """The API key held by the environment variable ``name`` (``api_key_env``)."""
    key = os.environ.get(name, "")
    if not key:
        raise ValueError(f"api_key_env={name}: the environment variable {name} is not set (or empty) on this node")
    return key


# engine settings that engine_kwargs may carry (the flat AppArgs keys passed to engine_config)
ENGINE_KWARGS = frozenset({
    "tensor_parallel_size", "pipeline_parallel_size", "pipeline_layer_split", "batches_in_flight", "dtype", "device", "block_size", "enable_prefix_caching", "num_kv_blocks",
    "kv_cache_memory_bytes", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
    "seed", "cpu_matmul_precision", "placement_strategy", "enable_expert_parallel", "attention_backend", "cascade_attention", "max_worker_restarts",
    "max_consecutive_failed_steps",
    "worker_restart_window_s", "worker_restart_backoff_s", "max_n", "max_logprobs", "max_stop_sequences",
    "max_stop_token_ids", "max_stop_string_length", "max_stop_total_length", "num_host_kv_blocks", "kv_offload_bytes", "deterministic",
    "disable_hybrid_kv_cache_manager", "kv_cache_dtype",
    "max_prompt_logprobs_entries",
    "enforce_eager", "structured_output_max_length", "structured_output_max_depth", "structured_output_max_count",
    "structured_output_compile_timeout_s", "structured_output_max_pending_compiles",
    "structured_output_compile_threads",
})
# Serve deployment options that deployment_config / ingress_deployment_config may set
DEPLOYMENT_OPTIONS = frozenset({
    "num_replicas", "autoscaling_config", "max_ongoing_requests", "max_queued_requests",
    "graceful_shutdown_wait_loop_s", "graceful_shutdown_timeout_s", "health_check_period_s",
    "health_check_timeout_s",
})


def _with_options(options: dict, overrides: dict) -> dict:
    """Serve deployment ``options`` with ``overrides`` applied: replicas are fixed or autoscaled, not both."""
    merged = {**options, **overrides}
    if "autoscaling_config" in overrides:
        merged.pop("num_replicas", None)
    elif "num_replicas" in overrides:
        merged.pop("autoscaling_config", None)
    return merged


_JSON_EXAMPLES = {"engine_kwargs": '{"max_num_seqs": 64}', "model_loading_config": '{"model_id": "my-model"}'}


def _json_mapping(value: Any, name: str) -> Any:
    """A mapping-valued argument given as text (`serve run serve_app:app 'name={"key": 1}'` passes
    every value as a string) read as JSON; anything else is returned as it is."""
    if not isinstance(value, str):
        return value
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        example = _JSON_EXAMPLES.get(name, '{"num_replicas": 2}')
        raise ValueError(f"{name} must be a mapping; on the command line, a JSON object such as "
                         f"{name}='{example}' (got {value!r})")
    return parsed


def _flatten(data: Any, name: str, flat_keys: dict[str, str], shape: str, noun: str) -> Any:
    """``data[name]``, a nested mapping (or its JSON text), merged into the flat keys it names
    (``flat_keys``: nested key -> flat key); a key given both ways must agree."""
    if not isinstance(data, dict) or not data.get(name):
        return data
    nested = _json_mapping(data[name], name)
    if not isinstance(nested, dict):
        raise ValueError(f"{name} must be {shape}")
    unknown = sorted(set(nested) - set(flat_keys))
    if unknown:
        raise ValueError(f"{name}: unknown {noun} {unknown[0]!r} (known: {', '.join(sorted(flat_keys))})")
    merged = {**data, name: nested}
    for key, value in nested.items():
        flat = flat_keys[key]
        if data.get(flat) is not None and data[flat] != value:
            raise ValueError(f"{flat} is given as {data[flat]!r} and in {name} as {value!r}: give it once")
        merged[flat] = value
    return merged


class AppArgs(BaseModel):
    """Arguments of `serve run serve_app:app key=value ...` (validated; unknown keys are errors)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # a model directory or a Hugging Face repo id (resolved on every node through its Hugging Face cache,
    # downloaded where missing); default: the llama `small` preset, built if missing
    model: str | None = None
    revision: str | None = None  # of a repo id: a branch, tag or commit
    # Ray Serve LLM's shape: {"model_id": served name, "model_source": directory or repo id}
    model_loading_config: dict[str, Any] = Field(default_factory=dict)
    served_model_name: str | None = None
    tensor_parallel_size: int = 1
    # the layers in that many stages of tensor_parallel_size ranks each (activations passed stage to stage);
    # pipeline_layer_split: each stage's layer count (e.g. [10, 12, 10]) instead of as even as they go
    pipeline_parallel_size: int = 1
    pipeline_layer_split: list[int] | None = None
    batches_in_flight: int | None = None  # steps in flight under PP (default: one per stage)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # the GPU model the engines need (Ray's accelerator_type, e.g. "A10G", "L4", "H100"): implies
    # device cuda, and the engine bundles ask for a node with that GPU
    accelerator_type: str | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    # a second KV tier in host memory, per rank: blocks, or bytes (off by default)
    num_host_kv_blocks: int = 0
    kv_offload_bytes: int | None = None
    # Gemma 2 / 3: keep the sliding-window layers' blocks as the full layers' are, instead of releasing
    # those behind the window (vLLM's name)
    disable_hybrid_kv_cache_manager: bool = False
    # the KV pool's format: the model's dtype, or fp8 (e4m3) / fp8_e5m2 / int8 codes with a scale per token
    # and KV head (about half the bytes of bfloat16: twice the blocks in the same memory)
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"] = "auto"
    # batch-invariant numerics: a greedy request's tokens and logprobs do not depend on its batch
    deterministic: bool = False
    # the linear layers and MoE experts as bfloat16 x 3 products on AMX tiles where the CPU has AMX ("high"; weights
    # kept to ~16 bits of mantissa), or the float32 chain everywhere ("highest"); EngineConfig.cpu_matmul_precision
    cpu_matmul_precision: Literal["highest", "high"] = "highest"
    # False: decode steps replay CUDA graphs (CUDA, attention_backend triton); eager by default for now
    enforce_eager: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    seed: int = 0
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"
    # mixture-of-experts models at tensor_parallel_size > 1: whole experts per rank (vLLM's name)
    enable_expert_parallel: bool = False
    attention_backend: Literal["auto", "torch", "cpu", "triton"] = "auto"
    cascade_attention: bool = True
    max_worker_restarts: int = 3  # rank-group rebuilds within worker_restart_window_s before the engine is dead
    worker_restart_window_s: float = 600.0
    worker_restart_backoff_s: float = 1.0
    max_consecutive_failed_steps: int = 3  # steps of one request failing in a row: the ranks are rebuilt
    max_n: int = 128  # caps on one request's work (a request over them gets a 400)
    max_logprobs: int = 20
    max_stop_sequences: int = 64
    max_stop_token_ids: int = 1024
    structured_output_max_length: int = 65536  # bounds of one structured-output constraint (EngineConfig)
    structured_output_max_depth: int = 64
    structured_output_max_count: int = 4096
    structured_output_compile_timeout_s: float = 10.0
    structured_output_max_pending_compiles: int = 64
    structured_output_compile_threads: int = 2
    max_stop_string_length: int = 1024  # characters of one stop string, and of all of them
    max_stop_total_length: int = 16384
    max_prompt_logprobs_entries: int = 100_000  # prompt tokens x (prompt_logprobs + 1) x n
    max_prompts_per_request: int = Field(256, ge=1)  # the Ingress's caps: prompts in one completion request,
    max_request_body_bytes: int = Field(32 * 2**20, ge=1)  # and the bytes of one HTTP request body
    num_replicas: int | None = None
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 16.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 120.0
    look_back_period_s: float = Field(12.0, gt=0)  # the window Serve averages the load over
    router: Literal["prefix", "pow2"] = "prefix"
    router_imbalance: int = 8  # queue-length gap beyond which the router prefers the least loaded replica
    api_key: str | None = None
    # the name of an environment variable that holds the API key on the Ingress's node: the key itself
    # never enters Serve's stored config or its logs
    api_key_env: str | None = None
    api_key_file: str | None = None  # or a file holding it on the Ingress's node (a mounted Secret)
    max_waiting_requests: int = 512
    stream_interval: int = Field(1, ge=1)  # streamed tokens per chunk (fewer, larger SSE chunks when > 1)
    # how tool calls are read out of the model's text under tool_choice "auto": generic (JSON, else Hermes
    # <tool_call> blocks), hermes, llama3_json
    tool_call_parser: str = "generic"
    # logical CPUs of the engine bundle (tp = 1) or of each rank bundle (at least 1: a rank actor takes one);
    # default: on a CPU device the node's CPUs less the serving actors' reservations (cluster/reservations.py),
    # on a GPU 1
    engine_cpus: float | None = Field(None, gt=0)
    # intra-op threads of the engine at tp = 1; default: engine_cpus where it is given, else the engine's
    # share of the node's physical cores (cluster/cpu_plan.py)
    torch_threads: int | None = Field(None, ge=1)
    # on a CPU device, bind the engine's threads to cores it claims on its node (cluster/cpu_plan.py)
    bind_threads: bool = True
    # logical CPUs of each Ingress and LLMServer replica (and of the scheduler actor at tp > 1); default
    # 0.5, less, down to none, where the cluster's CPUs are too few (see plan_reservations)
    proxy_cpus: float | None = Field(None, ge=0)
    # times a replica rebuilds its scheduler actor in place after it died; beyond, its health check fails
    # and Serve replaces the replica
    max_engine_restarts: int = Field(3, ge=0)
    # Ray Serve LLM's shapes: engine settings by name (merged into the flat keys above), and options
    # of the LLMServer and Ingress deployments (over what the app derives)
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    deployment_config: dict[str, Any] = Field(default_factory=dict)
    ingress_deployment_config: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _engine_kwargs(cls, data: Any) -> Any:
        """engine_kwargs' settings become the flat keys (a key given both ways must agree)."""
        return _flatten(data, "engine_kwargs", {key: key for key in ENGINE_KWARGS}, "a mapping of engine settings",
                        "engine setting")

    @model_validator(mode="before")
    @classmethod
    def _deployment_configs(cls, data: Any) -> Any:
        """deployment_config and ingress_deployment_config may come as JSON text (the command line)."""
        if not isinstance(data, dict):
            return data
        return {**data, **{name: _json_mapping(data[name], name) for name in ("deployment_config",
                                                                              "ingress_deployment_config")
                           if name in data}}

    @model_validator(mode="before")
    @classmethod
    def _model_loading_config(cls, data: Any) -> Any:
        """model_loading_config's model_source and model_id become model and served_model_name."""
        return _flatten(data, "model_loading_config", {"model_source": "model", "model_id": "served_model_name"},
                        "a mapping with model_id and model_source", "key")

    @model_validator(mode="before")
    @classmethod
    def _layer_split(cls, data: Any) -> Any:
        """pipeline_layer_split on the command line: "10,12,10" (or JSON, "[10, 12, 10]")."""
        if not isinstance(data, dict) or not isinstance(data.get("pipeline_layer_split"), str):
            return data
        text = data["pipeline_layer_split"].strip()
        try:
            split = json.loads(text) if text.startswith("[") else [int(n) for n in text.split(",")]
        except ValueError:
            split = None
        if not isinstance(split, list):
            raise ValueError(f"pipeline_layer_split must list each stage's layer count, such as "
                             f"pipeline_layer_split=10,12,10 (got {text!r})")
        return {**data, "pipeline_layer_split": split}

    @model_validator(mode="after")
    def _tool_call_parser(self) -> AppArgs:
        check_tool_parser(self.tool_call_parser)
        return self

    @model_validator(mode="after")
    def _deployment_options(self) -> AppArgs:
        for name in ("deployment_config", "ingress_deployment_config"):
            unknown = sorted(set(getattr(self, name)) - DEPLOYMENT_OPTIONS)
            if unknown:
                raise ValueError(f"{name}: unknown option {unknown[0]!r} (known: {', '.join(sorted(DEPLOYMENT_OPTIONS))})")
        return self

    @property
    def autoscaling(self) -> bool:
        if "autoscaling_config" in self.deployment_config or "num_replicas" in self.deployment_config:
            return "autoscaling_config" in self.deployment_config
        return self.min_replicas is not None or self.max_replicas is not None

    @model_validator(mode="after")
    def _replicas(self) -> AppArgs:
        if self.autoscaling and self.num_replicas is not None:
            raise ValueError("give num_replicas, or min_replicas/max_replicas for autoscaling, not both")
        low, high = self.replica_range
        if self.autoscaling and not 0 <= low <= high:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas, got {low} and {high}")
        if self.accelerator_type is not None and self.device == "cpu":
            raise ValueError(f"accelerator_type={self.accelerator_type} asks for a GPU but device is cpu: give one")
        given = [name for name in ("api_key", "api_key_env", "api_key_file") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"give one of api_key, api_key_env and api_key_file, not {' and '.join(given)}")
        if self.tensor_parallel_size * self.pipeline_parallel_size > 1 and self.engine_cpus is not None \
                and self.engine_cpus < 1:
            raise ValueError(f"engine_cpus={self.engine_cpus:g} is less than the one CPU each rank actor takes: give "
                             f"engine_cpus >= 1 at tensor_parallel_size or pipeline_parallel_size > 1")
        return self

    @property
    def replica_range(self) -> tuple[int, int]:
        """(fewest, most) engine replicas: deployment_config's settings first, then the flat keys."""
        if "autoscaling_config" in self.deployment_config:
            auto = self.deployment_config["autoscaling_config"]
            low = int(auto.get("min_replicas", 1))
            return low, int(auto.get("max_replicas", max(1, low)))
        if "num_replicas" in self.deployment_config:
            return (int(self.deployment_config["num_replicas"]),) * 2
        if self.num_replicas is not None:
            return self.num_replicas, self.num_replicas
        low = self.min_replicas if self.min_replicas is not None else 1
        return low, self.max_replicas if self.max_replicas is not None else max(1, low)
