"""Python faces of the compiled layer ops (``elementwise.cpp``, ``linear.cpp``), shaped like the torch
versions in ``kernels.norms``, ``kernels.rotary``, ``act_and_mul`` and ``F.linear``: a layer that was
handed a ``CpuLayerOps`` calls these instead. Each is one dispatcher call (the op overloads are
looked up once)."""

from __future__ import annotations

import torch


class CpuLayerOps:
    def __init__(self, ops) -> None:
        self.ops = ops  # torch.ops.kvserve_cpu
        self.linear = ops.linear.default  # F.linear; float32 batches of up to 512 rows split across threads
        self.rms_norm = ops.rms_norm.default  # (x, weight, eps) -> normed
        self.silu_and_mul = ops.silu_and_mul.default  # [.., 2d] -> silu(gate) * up, [.., d]
        self._fused_add_rms_norm = ops.fused_add_rms_norm.default
        self._rotary = ops.rotary_embedding.default

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """In place: residual += x, x = rms_norm(residual); returns (x, residual)."""
        self._fused_add_rms_norm(x, residual, weight, eps)
        return x, residual

    def rotary_neox_(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate query [T, heads * d] and key [T, kv_heads * d] in place."""
        self._rotary(positions, query, key, cos_sin_cache, head_dim)
        return query, key
