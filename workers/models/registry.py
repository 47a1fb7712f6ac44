"""Model classes by Hugging Face ``architectures`` name, and the KV-cache geometry of a config."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch.nn as nn

from engine.config import sliding_window  # noqa: F401  (the engine owns the rule; re-exported)
from workers.layers.linear import kv_head_partition
from workers.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from workers.models.llama import LlamaForCausalLM
from workers.models.mixtral import MixtralForCausalLM
from workers.models.opt import OPTForCausalLM
from workers.models.phi3 import Phi3ForCausalLM
from workers.models.qwen2 import Qwen2ForCausalLM
from workers.models.qwen3 import Qwen3ForCausalLM
from workers.models.qwen3_moe import Qwen3MoeForCausalLM
from workers.parallel_state import TPGroup

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def resolve_architecture(hf_config: dict[str, Any]) -> type[nn.Module]:
    """The model class for the config's ``architectures`` (the first supported one)."""
    names = hf_config.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise ValueError(
        f"unsupported model architecture {names or '(config.json has no architectures)'}; "
        f"supported: {', '.join(ARCHITECTURES)}"
    )


class KVCacheShape(NamedTuple):
    """What one rank's KV pool holds: a (k_pool, v_pool) pair per layer, each
    [num_blocks, block_size, num_kv_heads, head_dim]."""

    num_layers: int
    num_kv_heads: int  # on this rank
    head_dim: int
    replicated: bool  # tp > num_kv_heads: each KV head is held by tp // num_kv_heads ranks


def kv_cache_shape(hf_config: dict[str, Any], tp_size: int) -> KVCacheShape:
    """The per-rank KV pool geometry of a config at tensor-parallel size ``tp_size``."""
    heads = hf_config["num_attention_heads"]
    num_kv_heads = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    _, per_rank = kv_head_partition(num_kv_heads, TPGroup(0, tp_size))
    return KVCacheShape(hf_config["num_hidden_layers"], per_rank, head_dim, tp_size > num_kv_heads)
