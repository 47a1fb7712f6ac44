"""Phi-3 / Phi-3.5 / Phi-4-mini (``Phi3ForCausalLM``): the Llama architecture with fused checkpoint
tensors, partial rotary and LongRoPE.

- The checkpoint holds ``qkv_proj`` (q rows, then k, then v) and ``gate_up_proj`` (gate rows, then up)
  fused. At load time each is cut into its q / k / v (gate / up) row ranges, lazily, and handed to the
  tensor-parallel layers as if the checkpoint had them apart: each rank reads its own query heads, its
  KV heads (replicated when tp exceeds them, as ``QKVParallelLinear`` does) and its gate / up rows.
- ``partial_rotary_factor`` (Phi-4-mini: 0.75) rotates the first int(head_dim * factor) dimensions of
  each head; the rest pass through.
- ``longrope`` (``short_factor`` / ``long_factor``, ``original_max_position_embeddings``, the attention
  factor as transformers computes it): see ``RotaryEmbedding``. A request whose prompt is longer than the
  original length is rotated with the long factors throughout, as one transformers forward over it is;
  a shorter one with the short factors, and, if its decoding carries it past the original length, its
  later tokens with the long factors while the keys already cached keep their short rotation. That is
  vLLM's behaviour (its Phi3LongRoPE offsets only the positions of the current forward), not
  transformers' generate(): Phi-3's ``prepare_inputs_for_generation`` drops the KV cache when the
  sequence reaches original + 1 tokens and recomputes all of it with the long factors, so the tokens
  generated after the crossing can differ from transformers' generate(). The engine keeps the two
  kinds of requests apart in the prefix cache (``engine.config.long_rope_threshold``).
- Old configs' rope types ``su`` and ``yarn`` are LongRoPE, as transformers reads them for Phi-3.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch

from workers.layers import RotaryEmbedding, rope_parameters
from workers.models.llama import LlamaArgs, LlamaForCausalLM, LlamaModel
from workers.weight_loader import WeightSlice

ROPE_TYPES = ("default", "longrope")


class RowRange:
    """Rows [start, start + rows) of a lazily read checkpoint tensor, itself a ``WeightSlice``:
    ``part[a:b]`` reads rows start + a .. start + b of the whole, nothing else."""

    __slots__ = ("rows", "start", "weight")

    def __init__(self, weight: WeightSlice, start: int, rows: int) -> None:
        self.weight, self.start, self.rows = weight, start, rows

    def _rows(self, index: slice) -> slice:
        first, stop, step = index.indices(self.rows)
        if step != 1:
            raise ValueError("a fused tensor's part is read in whole row ranges")
        return slice(self.start + first, self.start + max(first, stop))

    def __getitem__(self, index: Any) -> torch.Tensor:
        if isinstance(index, slice):
            return self.weight[self._rows(index)]
        if isinstance(index, tuple) and index and isinstance(index[0], slice):
            return self.weight[(self._rows(index[0]), *index[1:])]
        raise ValueError(f"a fused tensor's part is read by row ranges, not {index!r}")

    def get_shape(self) -> list[int]:
        return [self.rows, *self.weight.get_shape()[1:]]


def _parse_rope(hf_config: dict[str, Any], head_dim: int) -> tuple[dict[str, Any], int]:
    """(rope parameters, rotary_dim) of a Phi-3 config; ValueError for what is not implemented."""
    params = rope_parameters(hf_config)
    if params["rope_type"] in ("su", "yarn"):
        params["rope_type"] = "longrope"
    if params["rope_type"] not in ROPE_TYPES:
        raise ValueError(f"Phi3ForCausalLM: rope type {params['rope_type']!r} is not supported "
                         f"(supported: {', '.join(ROPE_TYPES)})")
    factor = params.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
    params["partial_rotary_factor"] = factor
    rotary_dim = int(head_dim * factor)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(f"Phi3ForCausalLM: partial_rotary_factor {factor} gives a rotary width of {rotary_dim} "
                         f"for heads of {head_dim}; it must be even and within the head")
    if params["rope_type"] == "longrope":
        original = params.get("original_max_position_embeddings") or hf_config.get("original_max_position_embeddings")
        if not original:
            raise ValueError("Phi3ForCausalLM: longrope needs original_max_position_embeddings")
        params["original_max_position_embeddings"] = original
        for name in ("short_factor", "long_factor"):
            if len(params.get(name) or ()) != rotary_dim // 2:
                raise ValueError(f"Phi3ForCausalLM: longrope {name} must hold rotary_dim / 2 = {rotary_dim // 2} "
                                 f"values, not {len(params.get(name) or ())}")
    return params, rotary_dim


class Phi3Model(LlamaModel):
    @staticmethod
    def make_rotary(args: LlamaArgs, device: torch.device) -> RotaryEmbedding:
        rotary_dim = int(args.head_dim * args.rope["partial_rotary_factor"])  # checked by ``_parse_rope``
        return RotaryEmbedding(args.head_dim, args.max_position_embeddings, args.rope, device, rotary_dim)


class Phi3ForCausalLM(LlamaForCausalLM):
    """One tensor-parallel rank of a Phi-3-family causal LM."""

    model_cls = Phi3Model

    @staticmethod
    def parse_config(hf_config: dict[str, Any]) -> LlamaArgs:
        args = LlamaArgs.from_hf(hf_config)
        params, _ = _parse_rope(hf_config, args.head_dim)  # every check, once, with the whole config at hand
        # Phi-3 has no biases (transformers' Phi3 layers are bias-free whatever the config says)
        return replace(args, rope=params, qkv_bias=False, o_bias=False, mlp_bias=False)

    def _split_fused(self, weights: Iterable[tuple[str, WeightSlice]]) -> Iterator[tuple[str, WeightSlice]]:
        a = self.args
        q_rows, kv_rows = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        parts = {
            "qkv_proj": (("q_proj", 0, q_rows), ("k_proj", q_rows, kv_rows), ("v_proj", q_rows + kv_rows, kv_rows)),
            "gate_up_proj": (("gate_proj", 0, a.intermediate_size), ("up_proj", a.intermediate_size,
                                                                      a.intermediate_size)),
        }
        for name, weight in weights:
            fused = next((f for f in parts if f".{f}." in name), None)
            if fused is None:
                yield name, weight
                continue
            expected = sum(rows for *_, rows in parts[fused])
            if weight.get_shape()[0] != expected:
                raise ValueError(f"checkpoint tensor {name!r} has {weight.get_shape()[0]} rows where the config "
                                 f"gives {expected}")
            for part, start, rows in parts[fused]:
                yield name.replace(f".{fused}.", f".{part}."), RowRange(weight, start, rows)

    def load_weights(self, weights: Iterable[tuple[str, WeightSlice]]) -> None:
        super().load_weights(self._split_fused(weights))
