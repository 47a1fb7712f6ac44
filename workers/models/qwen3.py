"""Qwen3: the Llama architecture with an RMSNorm over each query and key head (``q_norm``, ``k_norm``,
weights of size head_dim) before rotary, and an explicit head_dim (128 where hidden / heads is 64).

``attention_bias`` puts biases on the q, k, v and o projections alike, as ``LlamaArgs`` reads it.
Sliding-window layers are not modelled (``registry.sliding_window`` reports a window).
``Qwen3Attention`` takes what ``LlamaAttention`` takes, so other Qwen3-family models (the MoE one)
build their layers from it.
"""

from __future__ import annotations

import torch

from kernels import PagedAttentionMetadata
from workers.layers import RMSNorm, RotaryEmbedding
from workers.models.llama import KVCache, LlamaArgs, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from workers.parallel_state import TPGroup


class Qwen3Attention(LlamaAttention):
    """LlamaAttention with per-head RMSNorms on q and k (replicated on every rank: they act on one
    head at a time). ``q_norm`` / ``k_norm`` are ``RMSNorm`` layers, so the compiled or Triton layer
    ops run them where bound, and the decoder stack reads their weights (``LlamaModel.bind_decoder_stack``)."""

    def __init__(
        self, args: LlamaArgs, rotary_emb: RotaryEmbedding, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__(args, rotary_emb, tp, dtype, device)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps, dtype, device)
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps, dtype, device)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache, meta: PagedAttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        t, d = x.shape[0], self.attn.head_dim
        # [T, heads * d] (a strided view of the fused output) -> heads of d, normalised -> a new [T, heads * d]
        q = self.q_norm(q.view(t, -1, d)).view(t, -1)
        k = self.k_norm(k.view(t, -1, d)).view(t, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    """One tensor-parallel rank of a Qwen3 (dense) causal LM."""

    model_cls = Qwen3Model
