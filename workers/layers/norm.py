"""Replicated normalisation layers: RMSNorm (with the residual add fused in) and LayerNorm."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """RMSNorm over the last axis. ``forward(x)`` -> normed x; ``forward(x, residual)`` adds x into the
    residual stream first and returns (normed, new residual)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps
        self.ops = None  # compiled layer ops (``workers.layers.kernels``): one fused pass, in place with a residual

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.ops is not None:
            if residual is None:
                return self.ops.rms_norm(x, self.weight, self.eps)
            return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


class LayerNorm(nn.Module):
    """LayerNorm over the last axis, with or without the affine weight and bias."""

    def __init__(
        self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device, elementwise_affine: bool = True
    ) -> None:
        super().__init__()
        self.normalized_shape, self.eps = (hidden_size,), eps
        self.weight = self.bias = None
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device), requires_grad=False)
            self.bias = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
