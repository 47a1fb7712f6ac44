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

DTYPES = [(torch.float32, 1e-5), (torch.float16, 2e-3)]


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
    torch.testing.assert_close(out, rms_norm(x, w, 1e-6), atol=tol, rtol=tol)
    torch.testing.assert_close(out.double(), naive_rms_norm(x, w, 1e-6).double(), atol=tol, rtol=tol)


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
    torch.testing.assert_close(normed, want_normed, atol=tol, rtol=tol)


def test_fused_add_rms_norm_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="one \\[rows, hidden\\] shape"):
        ops.fused_add_rms_norm(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 1e-6)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_silu_and_mul(dtype, tol):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 4, 2 * 48, generator=gen) * 3).to(dtype)
    out = ops.silu_and_mul(x)
    assert out.shape == (3, 4, 48)
    torch.testing.assert_close(out, F.silu(x[..., :48]) * x[..., 48:], atol=tol, rtol=tol)


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
    torch.testing.assert_close(q.view(tokens, heads, head_dim), want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(k.view(tokens, kv_heads, head_dim), want_k, atol=tol, rtol=tol)
    ref_q = naive_rotary(q0.view(tokens, heads, head_dim), positions, 10000.0, rot)
    torch.testing.assert_close(q.view(tokens, heads, head_dim).double(), ref_q.double(), atol=2 * tol, rtol=2 * tol)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # V untouched


def test_rotary_rejects_a_cache_wider_than_the_head():
    q, k = torch.zeros(2, 64), torch.zeros(2, 32)
    with pytest.raises(ValueError, match="rotary_dim 64 and the widths must fit head_dim 32"):
        ops.rotary_neox_(torch.tensor([0, 1]), q, k, _rope_cache(4, 64), 32)


def test_backend_fused_ops_are_these_kernels():
    fused = TritonAttentionBackend.fused_ops
    assert fused.rms_norm is ops.rms_norm and fused.fused_add_rms_norm is ops.fused_add_rms_norm
    assert fused.rotary_neox_ is ops.rotary_neox_ and fused.silu_and_mul is ops.silu_and_mul
    assert fused.linear is F.linear
