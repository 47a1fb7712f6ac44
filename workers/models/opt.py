"""OPT decoders: learned positions (offset 2), ReLU MLP, pre- or post-LayerNorm blocks, and the
project_in/project_out pair when ``word_embed_proj_dim`` != ``hidden_size`` (OPT-350m).

Checkpoint names may come with or without the ``model.`` prefix; the LM head is tied to embed_tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import PagedAttentionMetadata
from workers.layers import (
    Attention,
    ColumnParallelLinear,
    LayerNorm,
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    activation,
)
from workers.parallel_state import TPGroup
from workers.weight_loader import WeightSlice, load_into

KVCache = tuple[torch.Tensor, torch.Tensor]
LN_EPS = 1e-5


class OPTLearnedPositionalEmbedding(nn.Module):
    """Learned absolute positions, replicated: position p is row p + 2 of ``[max_positions + 2, hidden]``."""

    OFFSET = 2

    def __init__(self, max_positions: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        shape = (max_positions + self.OFFSET, hidden_size)
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions + self.OFFSET, self.weight)


class OPTAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], tp: TPGroup, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden, heads, bias = cfg["hidden_size"], cfg["num_attention_heads"], cfg.get("enable_bias", True)
        d = hidden // heads
        self.qkv_proj = QKVParallelLinear(hidden, d, heads, heads, bias, tp, dtype, device)
        heads_per_rank = self.qkv_proj.num_heads_per_rank
        self.out_proj = RowParallelLinear(hidden, hidden, bias, tp, dtype, device)
        self.attn = Attention(heads_per_rank, heads_per_rank, d, d**-0.5)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, meta: PagedAttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        return self.out_proj(self.attn(q, k, v, kv_cache, meta))


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], tp: TPGroup, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden, ffn, bias = cfg["hidden_size"], cfg["ffn_dim"], cfg.get("enable_bias", True)
        affine = cfg.get("layer_norm_elementwise_affine", True)
        self.pre_norm = cfg.get("do_layer_norm_before", True)
        self.self_attn = OPTAttention(cfg, tp, dtype, device)
        self.self_attn_layer_norm = LayerNorm(hidden, LN_EPS, dtype, device, affine)
        self.fc1 = ColumnParallelLinear(hidden, ffn, bias, tp, dtype, device)
        self.fc2 = RowParallelLinear(ffn, hidden, bias, tp, dtype, device)
        self.final_layer_norm = LayerNorm(hidden, LN_EPS, dtype, device, affine)
        self.act = activation(cfg.get("activation_function", "relu"))

    def _residual(
        self, x: torch.Tensor, norm: LayerNorm, block: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        return x + block(norm(x)) if self.pre_norm else norm(x + block(x))

    def forward(self, hidden: torch.Tensor, kv_cache: KVCache, meta: PagedAttentionMetadata) -> torch.Tensor:
        hidden = self._residual(hidden, self.self_attn_layer_norm, lambda x: self.self_attn(x, kv_cache, meta))
        return self._residual(hidden, self.final_layer_norm, lambda x: self.fc2(self.act(self.fc1(x))))


class OPTDecoder(nn.Module):
    def __init__(self, cfg: dict[str, Any], tp: TPGroup, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden, embed_dim = cfg["hidden_size"], cfg.get("word_embed_proj_dim") or cfg["hidden_size"]
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], embed_dim, tp, dtype, device)
        self.embed_positions = OPTLearnedPositionalEmbedding(cfg["max_position_embeddings"], hidden, dtype, device)
        self.project_in = self.project_out = None
        if embed_dim != hidden:
            self.project_in = ReplicatedLinear(embed_dim, hidden, False, dtype, device)
            self.project_out = ReplicatedLinear(hidden, embed_dim, False, dtype, device)
        self.final_layer_norm = None
        if cfg.get("do_layer_norm_before", True) and not cfg.get("_remove_final_layer_norm", False):
            affine = cfg.get("layer_norm_elementwise_affine", True)
            self.final_layer_norm = LayerNorm(hidden, LN_EPS, dtype, device, affine)
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg, tp, dtype, device) for _ in range(cfg["num_hidden_layers"]))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: PagedAttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        hidden = hidden + self.embed_positions(positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, kv_cache, meta)
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        return hidden if self.project_out is None else self.project_out(hidden)


class OPTForCausalLM(nn.Module):
    """One tensor-parallel rank of an OPT causal LM. ``forward`` returns [T, word_embed_proj_dim]."""

    stacked_params = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"))

    def __init__(self, hf_config: dict[str, Any], tp: TPGroup, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.decoder = OPTDecoder(hf_config, tp, dtype, device)
        self.tie_word_embeddings = hf_config.get("tie_word_embeddings", True)
        embed = self.decoder.embed_tokens
        self.lm_head = ParallelLMHead(
            embed.vocab_size, embed.weight.shape[1], tp, dtype, device,
            tied_to=embed if self.tie_word_embeddings else None,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: PagedAttentionMetadata,
    ) -> torch.Tensor:
        return self.decoder(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> None:
        ignore = ("lm_head.weight",) if self.tie_word_embeddings else ()
        renamed = ((name.removeprefix("model."), weight) for name, weight in weights)
        load_into(self, renamed, self.stacked_params, ignore)
