"""Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3 text (``Gemma3ForCausalLM``, model_type gemma3_text).

Per layer and rank, as transformers computes them::

    h = x + post_attention_norm(attn(input_norm(x)))        (Gemma 3: per-head q/k norms before rotary)
    out = h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))     mlp = down(gelu_tanh(gate) * up)

- Embeddings scaled by sqrt(hidden), the scale rounded to the weights' dtype first.
- RMSNorm with ``(1 + weight)``, computed in float32 and cast back (``GemmaRMSNorm``).
- Attention scaled by ``query_pre_attn_scalar ** -0.5``. Sliding layers (``layer_types``; else
  Gemma 2: every other layer from the first, Gemma 3: five of every ``sliding_window_pattern``) see the
  last ``sliding_window`` positions only, in every attention backend (``kernels``: the window is the
  kernels'). Gemma 2 soft-caps attention logits (``attn_logit_softcapping``); Gemma 3's attention
  ignores that setting, as transformers' does. Both soft-cap the final logits where
  ``final_logit_softcapping`` is set.
- Gemma 3's local layers rotate with their own base (``rope_parameters["sliding_attention"]``, or
  ``rope_local_base_freq``), its global layers with theirs and their scaling (e.g. linear).
- The LM head is tied to the embedding.
- Under pipeline parallelism each stage builds and reads only its layers (the embedding on the first
  and last stages, the final norm and LM head on the last); the hidden state alone passes between
  stages. Each stage's KV pool holds the tensor pairs of its layers in the whole model's KV layout
  (``engine.kv_layout``: hybrid or not), the block ids and window tables being the scheduler's.

The norms and the GeGLU run as plain torch (the compiled and Triton layer ops implement Llama's
forms); rotary, the linear layers and attention run on the engine's backend.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from engine.kv_layout import window_layer_flags
from kernels import PagedAttentionMetadata
from workers.layers import (
    Attention,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    act_and_mul,
    activation,
    rope_parameters,
)
from workers.models.llama import MissingLayer, outside_stage
from workers.parallel_state import PipelineStage, TPGroup
from workers.weight_loader import WeightSlice, load_into

KVCache = tuple[torch.Tensor, torch.Tensor]


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + weight)`` over the last axis, in float32, cast back to x's dtype."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


def _gemma3_rope(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global layers' rope settings, local layers'), from transformers-5 ``rope_parameters`` keyed by
    layer type or the older ``rope_theta`` + ``rope_scaling`` and ``rope_local_base_freq``."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full = dict(cfg.get("rope_scaling") or {})
        local = {}
    full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
    positions = cfg["max_position_embeddings"]
    return (rope_parameters({"rope_parameters": full, "max_position_embeddings": positions}),
            rope_parameters({"rope_parameters": local, "max_position_embeddings": positions}))


class GemmaAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], rotary_emb: RotaryEmbedding, window: int, softcap: float, qk_norm: bool,
                 tp: TPGroup, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        d, heads = cfg["head_dim"], cfg["num_attention_heads"]
        bias = cfg.get("attention_bias", False)
        self.qkv_proj = QKVParallelLinear(cfg["hidden_size"], d, heads, cfg.get("num_key_value_heads") or heads, bias,
                                          tp, dtype, device)
        h, kvh = self.qkv_proj.num_heads_per_rank, self.qkv_proj.num_kv_heads_per_rank
        self.split_sizes = [h * d, kvh * d, kvh * d]
        self.o_proj = RowParallelLinear(heads * d, cfg["hidden_size"], bias, tp, dtype, device)
        self.q_norm = self.k_norm = None
        if qk_norm:
            self.q_norm = GemmaRMSNorm(d, cfg["rms_norm_eps"], dtype, device)
            self.k_norm = GemmaRMSNorm(d, cfg["rms_norm_eps"], dtype, device)
        self.rotary_emb, self.head_dim = rotary_emb, d
        self.attn = Attention(h, kvh, d, float(cfg["query_pre_attn_scalar"]) ** -0.5, window, softcap)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache,
                meta: PagedAttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        if self.q_norm is not None:
            t, d = x.shape[0], self.head_dim
            q = self.q_norm(q.reshape(t, -1, d)).view(t, -1)
            k = self.k_norm(k.reshape(t, -1, d)).view(t, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class GemmaMLP(nn.Module):
    def __init__(self, cfg: dict[str, Any], tp: TPGroup, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], False, tp, dtype, device)
        self.down_proj = RowParallelLinear(inter, hidden, False, tp, dtype, device)
        self.act = activation(cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(act_and_mul(self.gate_up_proj(x), self.act))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], attention: GemmaAttention, tp: TPGroup, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.self_attn = attention
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)
        self.mlp = GemmaMLP(cfg, tp, dtype, device)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype, device)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache,
                meta: PagedAttentionMetadata) -> torch.Tensor:
        h = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), kv_cache, meta))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaModel(nn.Module):
    """The embedding, the decoder layers and the final norm. Under pipeline parallelism (``stage``) the
    layers outside the stage are ``MissingLayer``s (layer indices stay the checkpoint's, and so does
    which layers slide), the embedding is held by the first stage and by the last (the LM head is tied
    to it), the final norm by the last; a stage after the first takes the previous one's hidden state
    as ``intermediate`` (Gemma carries no separate residual stream), and one before the last answers it."""

    def __init__(self, cfg: dict[str, Any], gemma3: bool, tp: TPGroup, dtype: torch.dtype,
                 device: torch.device, stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.stage = stage = stage or PipelineStage.whole(cfg["num_hidden_layers"])
        hidden = cfg["hidden_size"]
        # the first stage embeds, the last holds the embedding for the tied LM head
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], hidden, tp, dtype, device) \
            if stage.is_first or stage.is_last else None
        self.embed_scale = float(torch.tensor(hidden**0.5, dtype=dtype))  # rounded to the weights' dtype, as HF
        d, positions = cfg["head_dim"], cfg["max_position_embeddings"]
        if gemma3:
            global_rope, local_rope = _gemma3_rope(cfg)
            softcap = 0.0  # transformers' Gemma 3 attention does not apply attn_logit_softcapping
        else:
            global_rope = local_rope = rope_parameters(cfg)
            softcap = float(cfg.get("attn_logit_softcapping") or 0.0)
        global_emb = RotaryEmbedding(d, positions, global_rope, device)
        local_emb = global_emb if local_rope == global_rope else RotaryEmbedding(d, positions, local_rope, device)
        window = int(cfg.get("sliding_window") or 0)
        # which layers slide: the KV layout's rule (engine.kv_layout), for this class's architecture
        self.sliding = window_layer_flags({**cfg, "architectures": ["Gemma3ForCausalLM" if gemma3 else
                                                                     "Gemma2ForCausalLM"]})
        if any(self.sliding) and window < 1:
            raise ValueError(f"sliding_attention layers need sliding_window >= 1, got {cfg.get('sliding_window')}")
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, GemmaAttention(cfg, local_emb if s else global_emb, window if s else 0, softcap,
                                                  gemma3, tp, dtype, device), tp, dtype, device)
            if stage.holds(i) else MissingLayer() for i, s in enumerate(self.sliding))
        self.norm = GemmaRMSNorm(hidden, cfg["rms_norm_eps"], dtype, device) if stage.is_last else None

    def outside_stage(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` (``model.``-relative) belongs to what another stage holds."""
        if name.startswith("layers."):
            return not self.stage.holds(int(name.split(".", 2)[1]))
        return (name.startswith("embed_tokens.") and self.embed_tokens is None) or \
            (name.startswith("norm.") and self.norm is None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: PagedAttentionMetadata, intermediate: torch.Tensor | None = None) -> torch.Tensor:
        if intermediate is None:
            hidden = self.embed_tokens(input_ids) * self.embed_scale
        else:
            hidden = intermediate
        layers = self.layers if self.stage.size == 1 else self.layers[self.stage.start:self.stage.end]
        for layer, kv_cache in zip(layers, kv_caches, strict=True):
            hidden = layer(positions, hidden, kv_cache, meta)
        return self.norm(hidden) if self.norm is not None else hidden


class Gemma2ForCausalLM(nn.Module):
    """One tensor-parallel rank of a Gemma 2 causal LM (``Gemma3ForCausalLM`` below: Gemma 3 text), of
    one pipeline stage (``stage``)."""

    gemma3 = False
    supports_pipeline_parallel = True
    stacked_params = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, hf_config: dict[str, Any], tp: TPGroup, dtype: torch.dtype, device: torch.device,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        cfg = dict(hf_config)
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention is not supported: kvserve serves causal Gemma models only")
        if not cfg.get("tie_word_embeddings", True):
            raise ValueError("Gemma checkpoints with an untied lm_head (tie_word_embeddings false) are not supported")
        heads = cfg["num_attention_heads"]
        cfg.setdefault("head_dim", cfg["hidden_size"] // heads)
        cfg.setdefault("query_pre_attn_scalar", cfg["head_dim"])
        cfg.setdefault("rms_norm_eps", 1e-6)
        self.hidden_size = cfg["hidden_size"]
        self.model = GemmaModel(cfg, self.gemma3, tp, dtype, device, stage)
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"], tp, dtype, device,
                                      tied_to=self.model.embed_tokens) if self.model.stage.is_last else None
        self.final_softcap = float(cfg.get("final_logit_softcapping") or 0.0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: PagedAttentionMetadata, intermediate: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta, intermediate)

    def intermediate_shape(self, num_tokens: int) -> tuple[int, int]:
        """What a stage passes to the next: the hidden state."""
        return (num_tokens, self.hidden_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        if logits is not None and self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> None:
        load_into(self, weights, self.stacked_params, ("lm_head.weight",), skip=outside_stage(self))


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """One tensor-parallel rank of a Gemma 3 text model (``Gemma3ForCausalLM``, model_type gemma3_text)."""

    gemma3 = True
