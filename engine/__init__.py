"""The engine: scheduling, the paged KV cache's block tables, prefix caching, sampling parameters and
outputs. Pure Python: it imports neither torch nor ray (executors are loaded by name)."""

from engine.async_engine import AsyncLLM
from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from engine.core import EngineCore, EngineDeadError, EngineOverloadedError, RequestFailedError
from engine.llm import LLM, engine_config
from engine.messages import CompletionOutput, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "CacheConfig",
    "CompletionOutput",
    "EngineConfig",
    "EngineCore",
    "EngineDeadError",
    "EngineOverloadedError",
    "ModelConfig",
    "ParallelConfig",
    "RequestOutput",
    "RequestFailedError",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
    "SchedulerConfig",
    "engine_config",
]
