"""Model implementations of one tensor-parallel rank, exact against Hugging Face transformers."""

from workers.models.llama import LlamaForCausalLM
from workers.models.opt import OPTForCausalLM
from workers.models.phi3 import Phi3ForCausalLM
from workers.models.qwen2 import Qwen2ForCausalLM
from workers.models.qwen3 import Qwen3ForCausalLM
from workers.models.registry import (
    ARCHITECTURES,
    KVCacheShape,
    kv_cache_shape,
    resolve_architecture,
    sliding_window,
)

__all__ = [
    "ARCHITECTURES",
    "KVCacheShape",
    "LlamaForCausalLM",
    "OPTForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "kv_cache_shape",
    "resolve_architecture",
    "sliding_window",
]
