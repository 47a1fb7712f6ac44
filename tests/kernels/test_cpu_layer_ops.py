"""The compiled norm, activation and rotary ops against the plain torch versions."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kernels import apply_rotary_emb, fused_add_rms_norm, rms_norm
from kernels.reference import naive_rms_norm, naive_rotary
from tests.compiled import cpu_backend_or_skip, threads

OPS = cpu_backend_or_skip().layer_ops
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


def _packed(weight: torch.Tensor) -> torch.Tensor:
    panel = OPS.panel_width
    out = torch.empty(weight.shape[0] // panel, weight.shape[1], panel)
    OPS.pack_linear_weight(weight, out)
    return out


def test_pack_linear_weight_lays_out_column_panels():
    panel = OPS.panel_width
    weight = torch.randn(3 * panel, 7, generator=torch.Generator().manual_seed(0))
    packed = _packed(weight.t().contiguous().t())  # any strides
    for p in range(3):
        assert torch.equal(packed[p], weight[p * panel:(p + 1) * panel].t())
    with pytest.raises(RuntimeError, match="multiple of"):
        OPS.pack_linear_weight(torch.randn(panel + 1, 7), torch.empty(1, 7, panel))


# rows: a tile and less, tile tails, several row blocks (120 / 240 rows per pass); depths: one pass
# (96), two passes with a short second (300), six (1408)
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 12, 13, 64, 121, 600])
@pytest.mark.parametrize("k", [96, 300, 1408])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(rows, k, with_bias):
    gen = torch.Generator().manual_seed(rows * k)
    n = 6 * OPS.panel_width
    x = torch.randn(rows, k, generator=gen)
    weight = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    got = OPS.linear(x, _packed(weight), bias)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-4 * math.sqrt(k), rtol=1e-5)
    # batch dimensions are kept, as F.linear keeps them
    assert OPS.linear(x.view(1, rows, k), _packed(weight), bias).shape == (1, rows, n)


@pytest.mark.parametrize("num_threads", [1, 2])
def test_packed_linear_rows_do_not_depend_on_the_batch(num_threads):
    """Every element is one chain over the inputs in order: a row's bits are the same alone, in any
    batch, at any position and with any number of threads."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(200, 700, generator=gen)
    packed = _packed(torch.randn(4 * OPS.panel_width, 700, generator=gen))
    bias = torch.randn(4 * OPS.panel_width, generator=gen)
    with threads(num_threads):
        full = OPS.linear(x, packed, bias)
        for lo, hi in [(0, 1), (7, 8), (3, 10), (120, 200), (13, 133)]:
            assert torch.equal(OPS.linear(x[lo:hi], packed, bias), full[lo:hi]), (lo, hi)
    assert torch.equal(OPS.linear(x, packed, bias), full)


def test_the_fixed_order_linear_takes_a_packed_weight_to_the_packed_product():
    """Deterministic mode binds the fixed-order linear everywhere; a packed weight there runs the
    packed product (batch-invariant too), bit for bit what the plain linear gives it."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(37, 100, generator=gen)
    packed = _packed(torch.randn(3 * OPS.panel_width, 100, generator=gen))
    bias = torch.randn(3 * OPS.panel_width, generator=gen)
    assert torch.equal(OPS.linear_fixed_order(x, packed, bias), OPS.linear(x, packed, bias))


def test_packed_linear_refuses_mismatched_inputs():
    packed = _packed(torch.randn(OPS.panel_width, 32))
    with pytest.raises(RuntimeError, match="features"):
        OPS.linear(torch.randn(3, 31), packed, None)
    with pytest.raises(RuntimeError, match="float32"):
        OPS.linear(torch.randn(3, 32, dtype=torch.bfloat16), packed, None)
