"""Rotary position embedding: the cos/sin cache of a model's rope settings, built once in float32."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from kernels import apply_rotary_emb


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The rope settings of a config, from transformers-5 ``rope_parameters`` or the older
    ``rope_scaling`` + ``rope_theta``; always with ``rope_type`` and ``rope_theta``. Under llama3, yarn and
    longrope (``su``: its old name) also with ``original_max_position_embeddings`` as transformers' rotary
    reads it (``standardize_rope_params``): a top-level one (Phi-3 keeps it there) wins over the rope
    settings' own, else max_position_embeddings."""
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params["rope_type"] in ("llama3", "yarn", "longrope", "su"):
        if hf_config.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = hf_config["original_max_position_embeddings"]
        else:
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


def _longrope_inv_freq(inv_freq_shape: torch.Tensor, base: float, factors: list[float]) -> torch.Tensor:
    """LongRoPE: each frequency divided by its own factor (transformers' order of operations)."""
    ext = torch.tensor(factors, dtype=torch.float32)
    if ext.shape != inv_freq_shape.shape:
        raise ValueError(f"longrope factors must number rotary_dim / 2 = {inv_freq_shape.numel()}, not {ext.numel()}")
    return 1.0 / (ext * base**inv_freq_shape)


def _longrope_attention_factor(params: dict[str, Any], max_position_embeddings: int) -> float:
    """transformers' rule: ``attention_factor`` if given, else sqrt(1 + ln(factor) / ln(original max)) with
    ``factor`` (default: max_position_embeddings / original_max_position_embeddings) above 1, else 1."""
    if params.get("attention_factor") is not None:
        return params["attention_factor"]
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / original_max
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max))


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding over the first ``rotary_dim`` dimensions of each head (all of them by
    default; the rest pass through), from a ``[rows, rotary_dim]`` float32 cache = cat(cos, sin).
    ``forward(positions [T], q [T, heads * d], k [T, kv_heads * d])``.

    Rope types: default, linear, llama3, yarn, longrope (what transformers computes, frequencies and the
    attention factors alike). Dynamic NTK is not supported: its frequencies depend on the longest
    sequence of the batch, which a per-position cache cannot express.

    longrope (Phi-3): transformers rotates every position of a forward with the long factors when the
    forward's longest position is at or past ``original_max_position_embeddings`` (the sequence is longer
    than it), with the short ones otherwise. The cache holds ``2 * max_positions`` rows: row p < max_positions
    is position p under the short factors below the original length and the long ones from it on, and row
    max_positions + p is position p under the long factors. ``long_rope`` = (original length,
    max_positions): the model runner offsets the positions of a request whose prompt is longer than the
    original length by max_positions, so a prompt wholly below it and one wholly above it are both rotated
    exactly as one transformers forward over the whole sequence rotates them. A short prompt that decoding
    carries past the original length gets its later tokens rotated with the long factors while the keys
    already cached keep their short rotation: vLLM's behaviour (its Phi3LongRoPE offsets only the positions
    of the current forward), not transformers' generate(), whose Phi-3 ``prepare_inputs_for_generation``
    drops the cache when the sequence reaches original + 1 tokens and recomputes all of it with the long
    factors; so tokens generated after the crossing can differ from transformers' generate().

    linear: positions are divided by ``factor`` (the frequencies are), and the cache holds the positions a
    request can reach, ``max_position_embeddings`` (the engine caps max_model_len there): Gemma 3's is
    already the extended length.
    """

    def __init__(
        self, head_dim: int, max_position_embeddings: int, params: dict[str, Any], device: torch.device,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        dim = head_dim if rotary_dim is None else rotary_dim
        if not 0 < dim <= head_dim or dim % 2:
            raise ValueError(f"rotary_dim must be even and within head_dim {head_dim}, not {dim}")
        rope_type, base = params["rope_type"], params["rope_theta"]
        inv_freq_shape = torch.arange(0, dim, 2, dtype=torch.float32) / dim
        inv_freq = 1.0 / (base**inv_freq_shape)
        max_positions, attention_factor = max_position_embeddings, 1.0
        self.long_rope: tuple[int, int] | None = None
        long_inv_freq = None
        if rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif rope_type == "yarn":
            inv_freq = _yarn_inv_freq(inv_freq, dim, base, params)
            attention_factor = _yarn_attention_factor(params)
            max_positions = max(max_positions, int(params["original_max_position_embeddings"] * params["factor"]))
        elif rope_type == "longrope":
            inv_freq = _longrope_inv_freq(inv_freq_shape, base, params["short_factor"])
            long_inv_freq = _longrope_inv_freq(inv_freq_shape, base, params["long_factor"])
            attention_factor = _longrope_attention_factor(params, max_position_embeddings)
            self.long_rope = (params["original_max_position_embeddings"], max_positions)
        elif rope_type != "default":
            raise ValueError(
                f"rope type {rope_type!r} is not supported (supported: default, linear, llama3, yarn, longrope)"
            )
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        if long_inv_freq is not None:
            long_freqs = torch.outer(positions, long_inv_freq)
            original = self.long_rope[0]
            freqs = torch.cat((freqs[:original], long_freqs[original:], long_freqs))
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
