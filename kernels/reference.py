"""Naive reference implementations the kernels are tested against: one sequence at a time,
contiguous K/V, explicit masks, float64 arithmetic. Slow and obviously right."""

from __future__ import annotations

import math

import torch


def naive_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None = None, window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention of ``query`` [q, heads, d] over ``key``/``value`` [k, kv_heads, d] (k >= q).

    The queries are the last q positions of the k-token context: query i sees keys 0..k-q+i, and with
    ``window`` > 0 only those above k-q+i-window; ``softcap`` > 0 maps each scaled score s to
    softcap * tanh(s / softcap) before the mask.
    """
    q_len, num_heads, head_dim = query.shape
    k_len, kv_heads, _ = key.shape
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    group = num_heads // kv_heads
    k = key.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, k, d]
    v = value.double().repeat_interleave(group, dim=1).transpose(0, 1)
    q = query.double().transpose(0, 1)
    scores = q @ k.transpose(1, 2) * scale  # [heads, q, k]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    rows = torch.arange(k_len - q_len, k_len)[:, None]
    hidden = torch.arange(k_len)[None, :] > rows
    if window:
        hidden |= torch.arange(k_len)[None, :] <= rows - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).to(query.dtype)


def naive_rotary(
    x: torch.Tensor, positions: torch.Tensor, base: float, rotary_dim: int | None = None
) -> torch.Tensor:
    """Neox-style rotary embedding computed from scratch: pairs (i, i + rotary_dim / 2)."""
    head_dim = x.shape[-1]
    rotary_dim = rotary_dim or head_dim
    half = rotary_dim // 2
    inv_freq = 1.0 / (base ** (torch.arange(0, half, dtype=torch.float64) * 2 / rotary_dim))
    angles = positions.double()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x64 = x.double()
    x1, x2 = x64[..., :half], x64[..., half:rotary_dim]
    out = x64.clone()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:rotary_dim] = x2 * cos + x1 * sin
    return out.to(x.dtype)


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return (weight.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
