"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorms, explicit head_dim) with a sparse mixture of
many small experts (``moe_intermediate_size`` each) in the layers ``decoder_sparse_step`` selects,
less ``mlp_only_layers``, which keep a dense MLP of ``intermediate_size``. The top k's softmax
weights are renormalised over the chosen only with ``norm_topk_prob``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from engine.config import num_experts
from workers.layers import RotaryEmbedding
from workers.layers.moe import FusedMoE
from workers.models.llama import LlamaArgs, LlamaMLP
from workers.models.mixtral import MixtralForCausalLM, MoeDecoderLayer
from workers.models.qwen3 import Qwen3Attention
from workers.parallel_state import TPGroup


def is_sparse_layer(hf_config: dict[str, Any], index: int) -> bool:
    """Whether layer ``index`` holds experts (as transformers' Qwen3MoeDecoderLayer decides)."""
    step = hf_config.get("decoder_sparse_step", 1) or 1
    return (index not in (hf_config.get("mlp_only_layers") or []) and num_experts(hf_config) > 0
            and (index + 1) % step == 0)


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    """One tensor-parallel rank of a Qwen3-MoE causal LM. ``expert_parallel``: whole experts per rank."""

    def make_layer(self, hf_config: dict[str, Any], index: int, args: LlamaArgs, rotary: RotaryEmbedding,
                   tp: TPGroup, dtype: torch.dtype, device: torch.device, expert_parallel: bool) -> nn.Module:
        if is_sparse_layer(hf_config, index):
            mlp: nn.Module = FusedMoE(
                num_experts(hf_config), hf_config["num_experts_per_tok"], args.hidden_size,
                hf_config["moe_intermediate_size"], bool(hf_config.get("norm_topk_prob", False)), args.hidden_act,
                tp, dtype, device, expert_parallel)
        else:
            mlp = LlamaMLP(args, tp, dtype, device)
        return MoeDecoderLayer(args, Qwen3Attention(args, rotary, tp, dtype, device), mlp, "mlp", dtype, device)
