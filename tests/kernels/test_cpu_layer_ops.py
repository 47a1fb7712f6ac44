"""The compiled norm, activation and rotary ops against the plain torch versions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import apply_rotary_emb, fused_add_rms_norm, rms_norm
from kernels.cpu import CpuAttentionBackend, load
from kernels.reference import naive_rms_norm, naive_rotary

OPS = CpuAttentionBackend(load()).layer_ops
TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 100), (300, 512)])
def test_rms_norm(dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=gen).to(dtype) * 3
    w = torch.randn(hidden, generator=gen).to(dtype)
    out = OPS.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(out, rms_norm(x, w, 1e-5), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(out.float(), naive_rms_norm(x, w, 1e-5).float(), atol=2 * TOL[dtype], rtol=2 * TOL[dtype])


@pytest.mark.parametrize("dtype", list(TOL))
def test_fused_add_rms_norm_in_place(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(33, 96, generator=gen).to(dtype)
    residual = torch.randn(33, 96, generator=gen).to(dtype)
    w = torch.randn(96, generator=gen).to(dtype)
    want_normed, want_residual = fused_add_rms_norm(x, residual, w, 1e-6)
    x_ptr, r_ptr = x.data_ptr(), residual.data_ptr()
    normed, new_residual = OPS.fused_add_rms_norm(x, residual, w, 1e-6)
    assert normed.data_ptr() == x_ptr and new_residual.data_ptr() == r_ptr  # in place
    torch.testing.assert_close(new_residual, want_residual, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(normed, want_normed, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("width", [16, 40, 1408])
def test_silu_and_mul(dtype, width):
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(21, 2 * width, generator=gen) * 6).to(dtype)  # covers large |x| on both sides
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(OPS.silu_and_mul(x), F.silu(gate) * up, atol=TOL[dtype] * 4, rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", list(TOL))
def test_rotary_in_place_on_strided_views(dtype):
    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, d = 9, 4, 2, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)  # rows strided by the fused width
    positions = torch.tensor([0, 1, 2, 7, 100, 101, 511, 3, 64])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(512, dtype=torch.float32), inv)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    want_q, want_k = apply_rotary_emb(q.reshape(tokens, heads, d), k.reshape(tokens, kv_heads, d), positions, cache)
    before = qkv.clone()
    OPS.rotary_neox_(positions, q, k, cache, d)
    torch.testing.assert_close(q.view(tokens, heads, d), want_q, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(k.view(tokens, kv_heads, d), want_k, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], before[:, (heads + kv_heads) * d:])  # v untouched
    ref = naive_rotary(before[:, :heads * d].view(tokens, heads, d).float(), positions, 10000.0)
    torch.testing.assert_close(q.view(tokens, heads, d).float(), ref, atol=4 * TOL[dtype], rtol=4 * TOL[dtype])


def test_rotary_rejects_a_position_outside_the_cache():
    q, k = torch.randn(2, 32), torch.randn(2, 32)
    cache = torch.randn(8, 32)
    with pytest.raises(RuntimeError, match="outside the rotary cache"):
        OPS.rotary_neox_(torch.tensor([1, 8]), q, k, cache, 32)


@pytest.mark.parametrize("rows", [1, 7, 64, 512, 513, 2048])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen)
    weight = torch.randn(200, 96, generator=gen)  # 200 columns: thread blocks of 64 and a ragged last one
    bias = torch.randn(200, generator=gen) if with_bias else None
    want = F.linear(x, weight, bias)
    packed = weight.t().contiguous().t()  # the layout workers.layers.kernels gives linear weights
    torch.testing.assert_close(OPS.linear(x, packed, bias), want, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(OPS.linear(x, weight, bias), want, atol=1e-4, rtol=1e-5)  # plain layout: F.linear


def test_linear_other_dtypes_fall_back():
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    weight = torch.randn(48, 32, dtype=torch.bfloat16).t().contiguous().t()
    torch.testing.assert_close(OPS.linear(x, weight, None), F.linear(x, weight))


@pytest.mark.parametrize("rows,n", [(1, 1), (3, 15), (5, 16), (7, 100), (48, 4096), (2, 50257)])
def test_argmax_rows_matches_torch(rows, n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(rows, n, generator=gen)
    assert torch.equal(OPS.argmax(x), x.argmax(dim=-1))
    # ties: the first of equal maxima, in any lane and in the tail
    x = torch.randint(0, 3, (rows, n), generator=gen).float()
    assert torch.equal(OPS.argmax(x), x.argmax(dim=-1))
    x = torch.full((rows, n), float("-inf"))
    assert torch.equal(OPS.argmax(x), x.argmax(dim=-1))


@pytest.mark.parametrize("where", [0, 5, 16, 17, 4095])
def test_argmax_rows_nan_is_picked_first(where):
    x = torch.randn(3, 4096, generator=torch.Generator().manual_seed(where))
    x[1, where] = float("nan")
    x[1, 4095 - where // 2] = float("nan")
    x[2, 100] = float("inf")
    assert torch.equal(OPS.argmax(x), x.argmax(dim=-1))


def test_argmax_rows_strided_rows():
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))[:, :257]  # a slice: row stride 300
    assert torch.equal(OPS.argmax(x), x.argmax(dim=-1))
