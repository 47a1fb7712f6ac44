"""Paged attention over the heads of one tensor-parallel rank."""

from __future__ import annotations

import torch
import torch.nn as nn

from kernels import PagedAttentionMetadata, paged_attention


class Attention(nn.Module):
    """Attention of this rank's heads against its KV pool shard.

    q [T, num_heads * head_dim], k/v [T, num_kv_heads * head_dim] -> [T, num_heads * head_dim]; the
    step's K/V are stored in ``kv_cache`` (k_pool, v_pool: [blocks, block_size, num_kv_heads, head_dim], or
    head_dim + 2 bytes a row for a quantized pool)
    before attending. ``window`` > 0: a sliding-window layer (the query at position p sees the keys at
    positions > p - window); ``softcap`` > 0: scores soft-capped to softcap * tanh(s / softcap).
    ``table``: which of the step's tables the layer reads (``engine.kv_layout``: 0 the block table,
    g >= 1 window group g - 1's, through ``meta.window_metas``); set by the model runner.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, window: int = 0,
                 softcap: float = 0.0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        if window < 0 or softcap < 0:
            raise ValueError(f"attention window and soft-cap must be >= 0, got {window} and {softcap}")
        self.window, self.softcap = int(window), float(softcap)
        self.table = 0

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: PagedAttentionMetadata,
    ) -> torch.Tensor:
        t = q.shape[0]
        if self.table:
            meta = meta.window_metas[self.table - 1]
        out = paged_attention(
            q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.num_kv_heads, self.head_dim),
            v.view(t, self.num_kv_heads, self.head_dim),
            kv_cache[0],
            kv_cache[1],
            meta,
            self.scale,
            self.window,
            self.softcap,
        )
        return out.view(t, self.num_heads * self.head_dim)
