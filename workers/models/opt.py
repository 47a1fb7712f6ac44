"""OPT decoders: learned positions (offset 2), ReLU MLP, pre- or post-LayerNorm blocks, and the
project_in/project_out pair when ``word_embed_proj_dim`` != ``hidden_size`` (OPT-350m).

Checkpoint names may come with or without the ``model.`` prefix; the LM head is tied to embed_tokens.
Under pipeline parallelism each stage builds and reads only its part (``OPTDecoder``), and the hidden
state alone passes between stages.
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
from workers.models.llama import MissingLayer, outside_stage
from workers.parallel_state import PipelineStage, TPGroup
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
    """The embeddings, the decoder layers and the final layer norm. Under pipeline parallelism
    (``stage``) the layers outside the stage are ``MissingLayer``s; the token embedding, the learned
    positions and ``project_in`` are the first stage's (the token embedding also the last's, where the
    LM head is tied to it), the final layer norm and ``project_out`` the last's. A stage after the
    first takes the previous one's hidden state as ``intermediate``; one before the last answers it."""

    def __init__(self, cfg: dict[str, Any], tp: TPGroup, dtype: torch.dtype, device: torch.device,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.stage = stage = stage or PipelineStage.whole(cfg["num_hidden_layers"])
        hidden, embed_dim = cfg["hidden_size"], cfg.get("word_embed_proj_dim") or cfg["hidden_size"]
        tied = cfg.get("tie_word_embeddings", True)
        self.embed_tokens = self.embed_positions = self.project_in = self.project_out = None
        if stage.is_first or (stage.is_last and tied):
            self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], embed_dim, tp, dtype, device)
        if stage.is_first:
            self.embed_positions = OPTLearnedPositionalEmbedding(cfg["max_position_embeddings"], hidden, dtype,
                                                                 device)
            if embed_dim != hidden:
                self.project_in = ReplicatedLinear(embed_dim, hidden, False, dtype, device)
        if stage.is_last and embed_dim != hidden:
            self.project_out = ReplicatedLinear(hidden, embed_dim, False, dtype, device)
        self.final_layer_norm = None
        if stage.is_last and cfg.get("do_layer_norm_before", True) and not cfg.get("_remove_final_layer_norm", False):
            affine = cfg.get("layer_norm_elementwise_affine", True)
            self.final_layer_norm = LayerNorm(hidden, LN_EPS, dtype, device, affine)
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg, tp, dtype, device) if stage.holds(i) else MissingLayer()
                                    for i in range(cfg["num_hidden_layers"]))

    def outside_stage(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` (``decoder.``-relative) belongs to what another stage holds."""
        if name.startswith("layers."):
            return not self.stage.holds(int(name.split(".", 2)[1]))
        part = name.split(".", 1)[0]
        return part in ("embed_tokens", "embed_positions", "project_in", "project_out", "final_layer_norm") \
            and getattr(self, part) is None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: PagedAttentionMetadata,
        intermediate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if intermediate is None:
            hidden = self.embed_tokens(input_ids)
            if self.project_in is not None:
                hidden = self.project_in(hidden)
            hidden = hidden + self.embed_positions(positions)
        else:
            hidden = intermediate
        layers = self.layers if self.stage.size == 1 else self.layers[self.stage.start:self.stage.end]
        for layer, kv_cache in zip(layers, kv_caches, strict=True):
            hidden = layer(hidden, kv_cache, meta)
        if not self.stage.is_last:
            return hidden
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        return hidden if self.project_out is None else self.project_out(hidden)


class OPTForCausalLM(nn.Module):
    """One tensor-parallel rank of an OPT causal LM (of one pipeline stage, ``stage``). ``forward``
    returns [T, word_embed_proj_dim] on the last stage, the hidden state [T, hidden] the next stage
    takes on the others."""

    stacked_params = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"))
    supports_pipeline_parallel = True

    def __init__(self, hf_config: dict[str, Any], tp: TPGroup, dtype: torch.dtype, device: torch.device,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.decoder = OPTDecoder(hf_config, tp, dtype, device, stage)
        self.hidden_size = hf_config["hidden_size"]
        self.tie_word_embeddings = hf_config.get("tie_word_embeddings", True)
        self.lm_head = None  # the last stage's, tied to the embedding it then holds
        if self.decoder.stage.is_last:
            vocab, embed_dim = hf_config["vocab_size"], hf_config.get("word_embed_proj_dim") or self.hidden_size
            self.lm_head = ParallelLMHead(vocab, embed_dim, tp, dtype, device,
                                          tied_to=self.decoder.embed_tokens if self.tie_word_embeddings else None)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: PagedAttentionMetadata,
        intermediate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.decoder(input_ids, positions, kv_caches, meta, intermediate)

    def intermediate_shape(self, num_tokens: int) -> tuple[int, int]:
        """What a stage passes to the next: the hidden state (OPT has no separate residual stream)."""
        return (num_tokens, self.hidden_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> None:
        ignore = ("lm_head.weight",) if self.tie_word_embeddings else ()
        renamed = ((name.removeprefix("model."), weight) for name, weight in weights)
        load_into(self, renamed, self.stacked_params, ignore, skip=outside_stage(self, "decoder"))
