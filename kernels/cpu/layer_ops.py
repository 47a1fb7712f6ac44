"""Python faces of the compiled elementwise ops (``elementwise.cpp``), shaped like the torch
versions in ``kernels.norms``, ``kernels.rotary`` and ``act_and_mul``: a layer that was handed a
``CpuLayerOps`` calls these instead."""

from __future__ import annotations

import torch


class CpuLayerOps:
    def __init__(self, ops) -> None:
        self.ops = ops  # torch.ops.kvserve_cpu

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty_like(rows)
        self.ops.rms_norm(out, rows, weight, eps)
        return out.view(x.shape)

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """In place: residual += x, x = rms_norm(residual); returns (x, residual)."""
        self.ops.fused_add_rms_norm(x.view(-1, x.shape[-1]), residual.view(-1, x.shape[-1]), weight, eps)
        return x, residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty(rows.shape[0], rows.shape[1] // 2, dtype=x.dtype)
        self.ops.silu_and_mul(out, rows)
        return out.view(*x.shape[:-1], x.shape[-1] // 2)

    def rotary_neox_(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate query [T, heads * d] and key [T, kv_heads * d] in place."""
        self.ops.rotary_embedding(positions, query, key, cos_sin_cache, head_dim)
        return query, key
