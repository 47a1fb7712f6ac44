"""The layers' elementwise ops as Triton kernels: RMSNorm with and without the residual add,
SiLU-and-multiply and neox rotary in place (``kernels.triton.ops`` re-exports them; ``_launch`` runs
them, so the warm-up's launch hooks see them)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.launch import _launch, _p2


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, out_ptr, weight_ptr, hidden, eps, stride_x, stride_r, stride_o,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:  # residual += x (rounded to the storage type), then normalise the residual
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    # weight * (x * inv) with the product rounded to the storage type first, as the torch version
    normed = (xf * inv).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=ok, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded, as torch does
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize_on_alignment=["positions_ptr"])
def _rotary_neox_kernel(
    positions_ptr, q_ptr, k_ptr, cache_ptr, stride_q, stride_k, stride_cache, num_q_heads, num_k_heads,
    head_dim, HALF: tl.constexpr, HALF_P2: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    i = tl.arange(0, HALF_P2)
    ok = i < HALF
    if head < num_q_heads:
        base = q_ptr + token * stride_q + head * head_dim
    else:
        base = k_ptr + token * stride_k + (head - num_q_heads) * head_dim
    x1 = tl.load(base + i, mask=ok, other=0.0)
    x2 = tl.load(base + HALF + i, mask=ok, other=0.0)
    # cos and sin rounded to the storage type first, as the torch version casts them
    c = tl.load(cache_ptr + pos * stride_cache + i, mask=ok, other=0.0).to(x1.dtype).to(tl.float32)
    s = tl.load(cache_ptr + pos * stride_cache + HALF + i, mask=ok, other=0.0).to(x1.dtype).to(tl.float32)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(base + i, (a * c - b * s).to(x1.dtype), mask=ok)
    tl.store(base + HALF + i, (b * c + a * s).to(x1.dtype), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last axis, into a new tensor."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _launch(_rms_norm_kernel, (rows.shape[0],), (rows, rows, out, weight, rows.shape[1], eps, rows.stride(0), 0,
                                                     out.stride(0)), dict(HAS_RESIDUAL=False, BLOCK=_p2(rows.shape[1])))
    return out.view(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``residual += x``, ``x = rms_norm(residual)``; returns (x, residual).
    Both [rows, hidden] with a contiguous last axis."""
    if x.dim() != 2 or x.stride(1) != 1 or residual.shape != x.shape or residual.stride(1) != 1:
        raise ValueError("fused_add_rms_norm takes x and residual of one [rows, hidden] shape, last axis contiguous")
    if x.shape[0]:
        _launch(_rms_norm_kernel, (x.shape[0],), (x, residual, x, weight, x.shape[1], eps, x.stride(0),
                                                  residual.stride(0), x.stride(0)),
                dict(HAS_RESIDUAL=True, BLOCK=_p2(x.shape[1])))
    return x, residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for x [..., 2d]."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    d = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], d, dtype=x.dtype, device=x.device)
    if rows.shape[0] and d:
        block = min(1024, _p2(d))
        _launch(_silu_and_mul_kernel, (rows.shape[0], triton.cdiv(d, block)), (rows, out, d, rows.stride(0),
                                                                                out.stride(0)), dict(BLOCK=block))
    return out.view(*x.shape[:-1], d)


def rotary_neox_(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
                 head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary in place over query [T, heads * d] and key [T, kv_heads * d] (rows may be strided
    views of a fused qkv output); ``cos_sin_cache`` [max_positions, rotary_dim] float32, cosines first."""
    if query.dim() != 2 or key.dim() != 2 or query.stride(1) != 1 or key.stride(1) != 1:
        raise ValueError("rotary_neox_ takes query and key as [tokens, heads * head_dim] with a contiguous last axis")
    rot = cos_sin_cache.shape[1]
    if rot % 2 or rot > head_dim or query.shape[1] % head_dim or key.shape[1] % head_dim:
        raise ValueError(f"rotary_neox_: rotary_dim {rot} and the widths must fit head_dim {head_dim}")
    num_q, num_k = query.shape[1] // head_dim, key.shape[1] // head_dim
    if query.shape[0]:
        _launch(_rotary_neox_kernel, (query.shape[0], num_q + num_k), (
            positions, query, key, cos_sin_cache, query.stride(0), key.stride(0), cos_sin_cache.stride(0),
            num_q, num_k, head_dim,
        ), dict(HALF=rot // 2, HALF_P2=_p2(rot // 2)))
    return query, key
