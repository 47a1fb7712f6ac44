"""Mixtral: the Llama/Mistral decoder with a sparse mixture-of-experts MLP in every layer (8 experts,
top 2, the chosen two's softmax weights renormalised to sum to one).

Per layer and rank: the Llama attention (``LlamaAttention``), then ``block_sparse_moe`` (router +
experts, ``workers.layers.moe.FusedMoE``): under tensor parallelism every expert's intermediate
features are split across ranks; with ``expert_parallel`` whole experts are (the same all-reduce
combines either). At tensor-parallel size 1 with the compiled kernels the layers run as one compiled call
(``LlamaModel.bind_decoder_stack``: the router and the compiled experts op inside the stack).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from kernels import PagedAttentionMetadata
from workers.layers import RMSNorm, RotaryEmbedding
from workers.layers.moe import FusedMoE, expert_route
from workers.models.llama import (
    KVCache,
    LlamaArgs,
    LlamaAttention,
    LlamaModel,
    MissingLayer,
    outside_stage,
    pre_norm_block,
    stage_lm_head,
)
from workers.parallel_state import PipelineStage, TPGroup
from workers.weight_loader import WeightSlice, load_into


@dataclass(frozen=True)
class MoeArgs:
    """The router's settings of a mixture-of-experts config."""

    num_experts: int
    top_k: int
    renormalize: bool
    expert_intermediate_size: int


def mixtral_moe_args(cfg: dict[str, Any]) -> MoeArgs:
    return MoeArgs(cfg["num_local_experts"], cfg["num_experts_per_tok"], True, cfg["intermediate_size"])


class MoeDecoderLayer(nn.Module):
    """RMSNorm -> attention -> RMSNorm -> ``mlp`` (a ``FusedMoE`` or a dense MLP), under the name the
    checkpoint gives it (``mlp_name``: ``block_sparse_moe`` in Mixtral, ``mlp`` in Qwen3-MoE)."""

    def __init__(self, args: LlamaArgs, attention: nn.Module, mlp: nn.Module, mlp_name: str, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        self.mlp_name = mlp_name
        setattr(self, mlp_name, mlp)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: PagedAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        return pre_norm_block(self, getattr(self, self.mlp_name), positions, hidden, residual, kv_cache, meta)


class MoeModel(LlamaModel):
    """The Llama model's embedding, layer loop and final norm around ``layers`` built by the caller."""

    def __init__(self, args: LlamaArgs, layers: list[nn.Module], tp: TPGroup, dtype: torch.dtype,
                 device: torch.device, stage: PipelineStage | None = None) -> None:
        nn.Module.__init__(self)
        self._build_ends(args, tp, dtype, device, stage)
        self.layers = nn.ModuleList(layers)


class MixtralForCausalLM(nn.Module):
    """One tensor-parallel rank of a Mixtral causal LM. ``expert_parallel``: whole experts per rank."""

    stacked_params = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                      ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))
    supports_expert_parallel = True
    supports_pipeline_parallel = True

    def __init__(self, hf_config: dict[str, Any], tp: TPGroup, dtype: torch.dtype, device: torch.device,
                 expert_parallel: bool = False, stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.args = args = LlamaArgs.from_hf(hf_config)
        stage = stage or PipelineStage.whole(args.num_layers)
        rotary = RotaryEmbedding(args.head_dim, args.max_position_embeddings, args.rope, device)
        layers = [self.make_layer(hf_config, i, args, rotary, tp, dtype, device, expert_parallel)
                  if stage.holds(i) else MissingLayer() for i in range(args.num_layers)]
        self.model = MoeModel(args, layers, tp, dtype, device, stage)
        self.lm_head = stage_lm_head(self.model, args, tp, dtype, device)

    def make_layer(self, hf_config: dict[str, Any], index: int, args: LlamaArgs, rotary: RotaryEmbedding,
                   tp: TPGroup, dtype: torch.dtype, device: torch.device, expert_parallel: bool) -> nn.Module:
        moe = mixtral_moe_args(hf_config)
        mlp = FusedMoE(moe.num_experts, moe.top_k, args.hidden_size, moe.expert_intermediate_size, moe.renormalize,
                       args.hidden_act, tp, dtype, device, expert_parallel)
        return MoeDecoderLayer(args, LlamaAttention(args, rotary, tp, dtype, device), mlp, "block_sparse_moe",
                               dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: PagedAttentionMetadata, intermediate: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> None:
        ignore = ("lm_head.weight",) if self.args.tie_word_embeddings else ()
        load_into(self, weights, self.stacked_params, ignore, route=expert_route, skip=outside_stage(self))
