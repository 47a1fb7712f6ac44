"""Llama 2/3 and Mistral-style decoders (GQA, explicit head_dim, optional biases, rope scaling).

Per layer and rank: qkv_proj (column, this rank's heads) -> rope -> paged attention -> o_proj (row,
all-reduce); gate_up_proj (column) -> act(gate) * up -> down_proj (row, all-reduce). RMSNorms carry
the residual stream: ``norm(x, residual)`` adds x into it, then normalises.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import PagedAttentionMetadata
from kernels.cpu.layer_ops import DecoderStack
from workers.layers import (
    Attention,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    act_and_mul,
    activation,
    rope_parameters,
)
from workers.layers.moe import FusedMoE
from workers.parallel_state import PipelineStage, TPGroup
from workers.weight_loader import WeightSlice, load_into

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class LlamaArgs:
    """The settings of a Llama-family config.json that shape the model."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    max_position_embeddings: int
    rope: dict[str, Any]
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlamaArgs:
        heads = cfg["num_attention_heads"]
        attention_bias = cfg.get("attention_bias", False)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            hidden_act=cfg.get("hidden_act", "silu"),
            max_position_embeddings=cfg["max_position_embeddings"],
            rope=rope_parameters(cfg),
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=cfg.get("mlp_bias", False),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        )


class LlamaAttention(nn.Module):
    def __init__(
        self, args: LlamaArgs, rotary_emb: RotaryEmbedding, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        d = args.head_dim
        self.qkv_proj = QKVParallelLinear(
            args.hidden_size, d, args.num_heads, args.num_kv_heads, args.qkv_bias, tp, dtype, device
        )
        heads, kv_heads = self.qkv_proj.num_heads_per_rank, self.qkv_proj.num_kv_heads_per_rank
        self.split_sizes = [heads * d, kv_heads * d, kv_heads * d]
        self.o_proj = RowParallelLinear(args.num_heads * d, args.hidden_size, args.o_bias, tp, dtype, device)
        self.rotary_emb = rotary_emb
        self.attn = Attention(heads, kv_heads, d, d**-0.5)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache, meta: PagedAttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class LlamaMLP(nn.Module):
    def __init__(self, args: LlamaArgs, tp: TPGroup, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden, inter = args.hidden_size, args.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], args.mlp_bias, tp, dtype, device)
        self.down_proj = RowParallelLinear(inter, hidden, args.mlp_bias, tp, dtype, device)
        self.act = activation(args.hidden_act)
        self.ops = None  # compiled layer ops (``workers.layers.kernels``): SiLU and the product in one pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and self.act is F.silu:
            return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))
        return self.down_proj(act_and_mul(self.gate_up_proj(x), self.act))


def pre_norm_block(layer: nn.Module, mlp: nn.Module, positions: torch.Tensor, hidden: torch.Tensor,
                   residual: torch.Tensor | None, kv_cache: KVCache, meta: PagedAttentionMetadata
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer of the Llama shape: ``layer.input_layernorm`` -> ``layer.self_attn`` ->
    ``layer.post_attention_layernorm`` -> ``mlp``, the norms carrying the residual stream."""
    if residual is None:
        hidden, residual = layer.input_layernorm(hidden), hidden
    else:
        hidden, residual = layer.input_layernorm(hidden, residual)
    hidden = layer.self_attn(positions, hidden, kv_cache, meta)
    hidden, residual = layer.post_attention_layernorm(hidden, residual)
    return mlp(hidden), residual


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[nn.Module] = LlamaAttention  # a subclass's attention (Qwen3's adds q/k norms)

    def __init__(
        self, args: LlamaArgs, rotary_emb: RotaryEmbedding, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        self.self_attn = self.attention_cls(args, rotary_emb, tp, dtype, device)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device)
        self.mlp = LlamaMLP(args, tp, dtype, device)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        meta: PagedAttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return pre_norm_block(self, self.mlp, positions, hidden, residual, kv_cache, meta)


class MissingLayer(nn.Module):
    """A layer another pipeline stage holds: no parameters, never run (it keeps the layer indices of
    ``layers`` those of the checkpoint)."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this layer is held by another pipeline stage")


class LlamaModel(nn.Module):
    """The embedding, the decoder layers and the final norm. Under pipeline parallelism (``stage``)
    the layers outside the stage are ``MissingLayer``s, the embedding is held by the first stage (and
    by the last where the LM head is tied to it), the final norm by the last; a stage after the first
    takes the previous one's (hidden, residual) stacked as ``intermediate``, and one before the last
    answers them so."""

    layer_cls: type[nn.Module] = LlamaDecoderLayer

    def __init__(self, args: LlamaArgs, tp: TPGroup, dtype: torch.dtype, device: torch.device,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self._build_ends(args, tp, dtype, device, stage)
        rotary_emb = self.make_rotary(args, device)
        self.layers = nn.ModuleList(self.layer_cls(args, rotary_emb, tp, dtype, device) if self.stage.holds(i)
                                    else MissingLayer() for i in range(args.num_layers))

    def _build_ends(self, args: LlamaArgs, tp: TPGroup, dtype: torch.dtype, device: torch.device,
                    stage: PipelineStage | None) -> None:
        """The stage, the embedding and the final norm where the stage holds them."""
        self.stage = stage or PipelineStage.whole(args.num_layers)
        embeds = self.stage.is_first or (self.stage.is_last and args.tie_word_embeddings)
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, tp, dtype, device) \
            if embeds else None
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device) if self.stage.is_last else None
        self.stack: DecoderStack | None = None  # the layers as one compiled call (``bind_decoder_stack``)

    def outside_stage(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` (``model.``-relative) belongs to what another stage holds."""
        if name.startswith("layers."):
            return not self.stage.holds(int(name.split(".", 2)[1]))
        return (name.startswith("embed_tokens.") and self.embed_tokens is None) or \
            (name.startswith("norm.") and self.norm is None)

    @staticmethod
    def make_rotary(args: LlamaArgs, device: torch.device) -> RotaryEmbedding:
        return RotaryEmbedding(args.head_dim, args.max_position_embeddings, args.rope, device)

    def bind_decoder_stack(self, layer_ops) -> bool:
        """Run the layers as one compiled call from now on (``workers.layers.kernels``), where the
        stack is what ``decoder_stack.cpp`` computes: one rank, SiLU-gated MLPs or mixtures of
        experts whose compiled experts op is bound (every expert on this rank), and the compiled norms
        and rotary already bound. Answers whether it did."""
        if self.stage.size > 1:  # the stack runs every layer, the embedding and the final norm
            return False
        first = self.layers[0]
        if first.self_attn.o_proj.tp.size != 1:
            return False
        if first.self_attn.rotary_emb.ops is None or self.norm.ops is None:
            return False
        qk_norms = None  # per-head q/k RMSNorms before rotary (Qwen3), with the layers' eps
        if hasattr(first.self_attn, "q_norm"):
            qk_norms = [(layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight) for layer in self.layers]
        layers, moe = [], []
        for layer in self.layers:
            attn = layer.self_attn
            mlp = getattr(layer, getattr(layer, "mlp_name", "mlp"))  # Mixtral's block_sparse_moe
            if isinstance(mlp, FusedMoE):  # the compiled experts, SiLU-gated (pack_for_cpu bound them)
                if mlp.cpu_experts is None or mlp.num_local_experts != mlp.num_experts:
                    return False
                mlp_weights = (mlp.gate.weight, mlp.gate.bias, mlp.w13_weight, mlp.w2_weight)
                moe.append((mlp.top_k, mlp.renormalize, mlp.intermediate))
            elif getattr(mlp, "act", None) is F.silu and mlp.ops is not None:
                mlp_weights = (mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, mlp.down_proj.weight, mlp.down_proj.bias)
                moe.append((0, False, 0))
            else:
                return False
            layers.append((layer.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias,
                           attn.o_proj.weight, attn.o_proj.bias, layer.post_attention_layernorm.weight, *mlp_weights))
        a = first.self_attn.attn
        self.stack = DecoderStack(layer_ops, layers, self.norm.weight, first.self_attn.rotary_emb.cos_sin_cache,
                                  a.num_heads, a.num_kv_heads, a.head_dim, self.norm.eps, a.scale, qk_norms,
                                  moe if any(top_k for top_k, _, _ in moe) else None)
        return True

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: PagedAttentionMetadata,
        intermediate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.stack is not None:
            return self.stack(self.embed_tokens(input_ids), positions, kv_caches, meta)
        if intermediate is None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate.unbind(0)
        layers = self.layers if self.stage.size == 1 else self.layers[self.stage.start:self.stage.end]
        for layer, kv_cache in zip(layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        if self.norm is None:
            return torch.stack((hidden, residual))
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """One tensor-parallel rank of a Llama-family causal LM (also serves MistralForCausalLM)."""

    stacked_params = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    model_cls: type[nn.Module] = LlamaModel

    @staticmethod
    def parse_config(hf_config: dict[str, Any]) -> LlamaArgs:
        return LlamaArgs.from_hf(hf_config)

    supports_pipeline_parallel = True

    def __init__(self, hf_config: dict[str, Any], tp: TPGroup, dtype: torch.dtype, device: torch.device,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.args = args = self.parse_config(hf_config)
        self.model = self.model_cls(args, tp, dtype, device, stage)
        self.lm_head = stage_lm_head(self.model, args, tp, dtype, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: PagedAttentionMetadata,
        intermediate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    @property
    def long_rope(self) -> tuple[int, int] | None:
        """Under LongRoPE (Phi-3): (original_max_position_embeddings, row offset of the long factors in the
        rotary cache), which the model runner applies to long prompts' positions; else None."""
        return self.model.layers[self.model.stage.start].self_attn.rotary_emb.long_rope

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> None:
        ignore = ("lm_head.weight",) if self.args.tie_word_embeddings else ()
        load_into(self, weights, self.stacked_params, ignore, skip=outside_stage(self))


def stage_lm_head(model: LlamaModel, args: LlamaArgs, tp: TPGroup, dtype: torch.dtype,
                  device: torch.device) -> ParallelLMHead | None:
    """The LM head, on the last stage only (tied to the embedding the last stage then holds)."""
    if not model.stage.is_last:
        return None
    tied_to = model.embed_tokens if args.tie_word_embeddings else None
    return ParallelLMHead(args.vocab_size, args.hidden_size, tp, dtype, device, tied_to=tied_to)


def outside_stage(causal_lm: nn.Module, body: str = "model"):
    """For ``load_into``: whether a checkpoint tensor belongs to what another pipeline stage holds (not
    read here); None for a model of one stage. ``body``: the attribute (and checkpoint prefix) of the
    layer stack that knows its stage (OPT's is ``decoder``)."""
    model = getattr(causal_lm, body)
    if model.stage.size == 1:
        return None
    prefix = f"{body}."

    def skip(name: str) -> bool:
        if name.startswith("lm_head."):
            return causal_lm.lm_head is None
        return name.startswith(prefix) and model.outside_stage(name[len(prefix):])

    return skip

