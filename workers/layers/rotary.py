"""Rotary position embedding: the cos/sin cache of a model's rope settings, built once in float32."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from kernels import apply_rotary_emb


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The rope settings of a config, from transformers-5 ``rope_parameters`` or the older
    ``rope_scaling`` + ``rope_theta``; always with ``rope_type`` and ``rope_theta``."""
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params["rope_type"] in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", hf_config["max_position_embeddings"])
    return params


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, base: float, params: dict[str, Any]) -> torch.Tensor:
    """Blend interpolated (low frequencies) and original (high frequencies) rotations over a ramp."""
    factor, original_max = params["factor"], params["original_max_position_embeddings"]
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def _yarn_attention_factor(params: dict[str, Any]) -> float:
    if params.get("attention_factor") is not None:
        return params["attention_factor"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = params["factor"], params.get("mscale"), params.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Divide low frequencies by ``factor``, keep high ones, interpolate smoothly in between."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding over whole heads, from a ``[max_positions, head_dim]`` float32
    cache = cat(cos, sin). ``forward(positions [T], q [T, heads * d], k [T, kv_heads * d])``.

    Rope types: default, linear, llama3, yarn (what transformers computes, frequencies and the yarn
    attention factor alike). Dynamic NTK is not supported: its frequencies depend on the longest
    sequence of the batch, which a per-position cache cannot express.
    """

    def __init__(
        self, head_dim: int, max_position_embeddings: int, params: dict[str, Any], device: torch.device
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        rope_type, base = params["rope_type"], params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        max_positions, attention_factor = max_position_embeddings, 1.0
        if rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
            max_positions = int(max_position_embeddings * params["factor"])
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif rope_type == "yarn":
            inv_freq = _yarn_inv_freq(inv_freq, head_dim, base, params)
            attention_factor = _yarn_attention_factor(params)
            max_positions = max(max_positions, int(params["original_max_position_embeddings"] * params["factor"]))
        elif rope_type != "default":
            raise NotImplementedError(
                f"rope type {rope_type!r} is not supported (supported: default, linear, llama3, yarn)"
            )
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor
        self.register_buffer("cos_sin_cache", cache.to(device), persistent=False)
        self.ops = None  # compiled layer ops (``workers.layers.kernels``): rotate q and k in place

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ops is not None:
            return self.ops.rotary_neox_(positions, q, k, self.cos_sin_cache, self.head_dim)
        t, d = q.shape[0], self.head_dim
        q, k = apply_rotary_emb(q.view(t, -1, d), k.view(t, -1, d), positions, self.cos_sin_cache)
        return q.view(t, -1), k.view(t, -1)
