"""A batch-invariant linear layer for ``deterministic=True`` on the Triton path: ``x @ w.T + b``
with one fixed tiling whatever the number of rows.

cuBLAS (and a CPU BLAS under the interpreter) choose their kernel, tile and split of the inner
dimension from the problem's shape, so a row's result changes with the number of rows beside it.
Here every launch uses the same tile sizes and no split of the inner dimension: each output element
is the sum of ``BLOCK_K``-wide partial dot products taken in order along ``K``, accumulated in
float32, whatever ``M`` is and wherever the row falls in its tile. Compiled, the partial products
are ``tl.dot``s (the tensor cores' result for an element does not depend on its row's place in the
tile); under the interpreter ``tl.dot`` is numpy's BLAS, whose result does depend on it, so there
they are multiplies summed along ``K``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.ops import INTERPRETED, _launch

# one tiling for every launch; the interpreter (tests on CPU) takes wider tiles: fewer programs and
# steps, each of which it runs op by op in Python (any fixed tiling is batch-invariant alike)
BLOCK_M, BLOCK_N, BLOCK_K = (32, 256, 64) if INTERPRETED else (32, 64, 32)


@triton.jit(do_not_specialize=["M"])  # the rows change from step to step
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_DOT: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inner = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + inner
        k_ok = k < K
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + k[None, :] * stride_xk,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols64[None, :] * stride_wn + k[:, None] * stride_wk,
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if USE_DOT:
            acc += tl.dot(x, w, input_precision=DOT_PRECISION)
        else:  # the interpreter's tl.dot is a BLAS call whose rows depend on where they sit in the tile
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], 1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows64[:, None] * stride_om + cols64[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def linear_batch_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (x [..., K], weight [N, K], bias [N] or None) whose every row is
    computed the same way whatever the number of rows."""
    if x.shape[-1] != weight.shape[1] or (bias is not None and bias.shape != (weight.shape[0],)):
        raise ValueError(f"linear: x [..., {x.shape[-1]}] against weight {tuple(weight.shape)}"
                         f"{'' if bias is None else f' and bias {tuple(bias.shape)}'}")
    rows = x.reshape(-1, x.shape[-1])
    m, k = rows.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        precision = "ieee" if x.dtype == torch.float32 else "tf32"
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        _launch(_linear_kernel, grid, (
            rows, weight, weight if bias is None else bias, out, m, n, k,
            rows.stride(0), rows.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        ), dict(HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT_PRECISION=precision,
                USE_DOT=not INTERPRETED))
    return out.view(*x.shape[:-1], n)
