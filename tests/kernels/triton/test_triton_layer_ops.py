"""The Triton layer ops under the interpreter against the torch versions and the naive reference:
RMSNorm, residual add + RMSNorm in place, SiLU-and-multiply, neox rotary in place on strided views."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.norms import fused_add_rms_norm, rms_norm
from kernels.reference import naive_rms_norm, naive_rotary
from kernels.rotary import apply_rotary_emb
from kernels.triton import TritonAttentionBackend, ops
from tests.kernels.triton.common import ulp


def _tol(dtype: torch.dtype) -> float:
    """Relative tolerance: float32 1e-5 (the sums run in another order than torch's); half precision two
    spacings of the dtype relative (2 eps): the kernel rounds as torch does (to the dtype after the
    norm's product, after SiLU, once at the end), its float32 math in between differing by far less
    than a spacing, so a result is the same or a neighbour. Not an absolute 2e-3: at |x| near 4 a
    float16 spacing is 4e-3."""
    return 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps


# (dtype, rtol); the absolute floor is the dtype's smallest normal times eps (its subnormals' spacing).
# Not bfloat16 here: the interpreter converts float32 to bfloat16 by truncation, not to nearest, so
# the residual's one rounding differs from torch's (tests/gpu runs bfloat16 compiled)
DTYPES = [(dtype, _tol(dtype)) for dtype in (torch.float32, torch.float16)]


def _close(got, want, dtype, rtol, atol=None):
    atol = atol if atol is not None else torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol)


def _rope_cache(max_pos, rot, base=10000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm(dtype, tol, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, hidden, generator=gen).to(dtype)
    w = (1 + torch.randn(hidden, generator=gen) / 4).to(dtype)
    out = ops.rms_norm(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    _close(out, rms_norm(x, w, 1e-6), dtype, tol)
    _close(out, naive_rms_norm(x, w, 1e-6), dtype, tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_fused_add_rms_norm_in_place(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 80, generator=gen).to(dtype)
    residual = torch.randn(6, 80, generator=gen).to(dtype)
    w = (1 + torch.randn(80, generator=gen) / 4).to(dtype)
    want_normed, want_residual = fused_add_rms_norm(x.clone(), residual.clone(), w, 1e-5)
    x_ptr, r_ptr = x.data_ptr(), residual.data_ptr()
    normed, new_residual = ops.fused_add_rms_norm(x, residual, w, 1e-5)
    assert normed.data_ptr() == x_ptr and new_residual.data_ptr() == r_ptr  # in place
    torch.testing.assert_close(new_residual, want_residual, atol=0, rtol=0)  # x + residual, rounded once
    _close(normed, want_normed, dtype, tol)


def test_fused_add_rms_norm_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="one \\[rows, hidden\\] shape"):
        ops.fused_add_rms_norm(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 1e-6)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_silu_and_mul(dtype, tol):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 4, 2 * 48, generator=gen) * 3).to(dtype)
    out = ops.silu_and_mul(x)
    assert out.shape == (3, 4, 48)
    _close(out, F.silu(x[..., :48]) * x[..., 48:], dtype, tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("head_dim,rot", [(64, 64), (40, 40), (64, 32)])
def test_rotary_neox_in_place_on_qkv_views(dtype, tol, head_dim, rot):
    gen = torch.Generator().manual_seed(head_dim + rot)
    heads, kv_heads, tokens = 4, 2, 7
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k = qkv[:, : heads * head_dim], qkv[:, heads * head_dim: (heads + kv_heads) * head_dim]  # strided views
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    q0, k0 = q.clone(), k.clone()
    positions = torch.tensor([0, 3, 17, 5, 99, 1, 40])
    cache = _rope_cache(128, rot)
    want_q, want_k = apply_rotary_emb(q0.view(tokens, heads, head_dim), k0.view(tokens, kv_heads, head_dim),
                                      positions, cache)
    got_q, got_k = ops.rotary_neox_(positions, q, k, cache, head_dim)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    # x1 cos - x2 sin can cancel: besides the relative part, what the products' rounding moves it by
    # (torch rounds each product to the dtype; the naive float64 reference rounds nothing, cos and
    # sin included): a spacing of the dtype at |x1| + |x2| of the pair
    for got, want, x0 in ((q.view(tokens, heads, head_dim), want_q, q0.view(tokens, heads, head_dim)),
                          (k.view(tokens, kv_heads, head_dim), want_k, k0.view(tokens, kv_heads, head_dim))):
        pair = _pair_magnitude(x0, rot)
        _within(got, want, 2 * ulp(want, dtype) + ulp(pair, dtype) if dtype != torch.float32 else 1e-5 * (1 + pair))
    ref_q = naive_rotary(q0.view(tokens, heads, head_dim), positions, 10000.0, rot)
    pair = _pair_magnitude(q0.view(tokens, heads, head_dim), rot)
    _within(q.view(tokens, heads, head_dim), ref_q,
            2 * ulp(ref_q, dtype) + 2 * ulp(pair, dtype) if dtype != torch.float32 else 2e-5 * (1 + pair))
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # V untouched


def _pair_magnitude(x: torch.Tensor, rot: int) -> torch.Tensor:
    """|x1| + |x2| of the rotary pair each element belongs to (0 past ``rot``)."""
    x = x.double().abs()
    half = rot // 2
    out = torch.zeros_like(x)
    out[..., :half] = x[..., :half] + x[..., half:rot]
    out[..., half:rot] = out[..., :half]
    return out


def _within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    err = (got.double() - want.double()).abs()
    assert (err <= bound).all(), f"{int((err > bound).sum())} beyond the bound, worst {(err / bound).max():.2f}x"


def test_rotary_rejects_a_cache_wider_than_the_head():
    q, k = torch.zeros(2, 64), torch.zeros(2, 32)
    with pytest.raises(ValueError, match="rotary_dim 64 and the widths must fit head_dim 32"):
        ops.rotary_neox_(torch.tensor([0, 1]), q, k, _rope_cache(4, 64), 32)


def test_backend_fused_ops_are_these_kernels():
    fused = TritonAttentionBackend.fused_ops
    assert fused.rms_norm is ops.rms_norm and fused.fused_add_rms_norm is ops.fused_add_rms_norm
    assert fused.rotary_neox_ is ops.rotary_neox_ and fused.silu_and_mul is ops.silu_and_mul
    assert fused.linear is F.linear
