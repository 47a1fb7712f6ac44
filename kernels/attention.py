"""The one dispatch point of paged attention: every layer calls ``paged_attention`` with the step's
metadata (``kernels.metadata``: the pool layout and the batch are described there), which names the
backend that runs it."""

from __future__ import annotations

import torch

from kernels.metadata import AttentionBackend, CascadeGroups, PagedAttentionMetadata
from kernels.torch_attention import TORCH_BACKEND

__all__ = ["AttentionBackend", "CascadeGroups", "PagedAttentionMetadata", "paged_attention"]


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Store this step's K/V, then attend for the whole mixed batch ([tokens, heads, d] in and out);
    ``window`` and ``softcap`` as ``AttentionBackend.forward`` says (0: none)."""
    backend = meta.backend or TORCH_BACKEND
    if not window and not softcap:
        return backend.forward(query, key, value, k_pool, v_pool, meta, scale)
    return backend.forward(query, key, value, k_pool, v_pool, meta, scale, window=window, softcap=softcap)
