"""Rotary position embedding applied from a precomputed cos/sin cache."""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    rot_dim = cos.shape[-1] * 2
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    if is_neox:  # halves: (x1, x2) = (x[:d/2], x[d/2:])
        x1, x2 = x_rot.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:  # interleaved pairs: (x[0::2], x[1::2])
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    if x_pass.shape[-1]:
        rotated = torch.cat((rotated, x_pass), dim=-1)
    return rotated


def apply_rotary_emb(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` [tokens, heads, d] and ``key`` [tokens, kv_heads, d] by their positions.

    ``cos_sin_cache`` is [max_positions, rotary_dim] with the cosines in the first half of the last
    axis and the sines in the second; dimensions past ``rotary_dim`` pass through unchanged.
    """
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    cos, sin = cos.to(query.dtype), sin.to(query.dtype)
    return _rotate(query, cos, sin, is_neox), _rotate(key, cos, sin, is_neox)
