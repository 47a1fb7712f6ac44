"""The Triton kernels compiled on CUDA against the naive reference (the interpreter runs the same
checks on CPU in ``tests/kernels/triton``), bfloat16 included. Run with `make test-gpu`."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kernels import select_backend
from kernels.norms import fused_add_rms_norm, rms_norm
from kernels.rotary import apply_rotary_emb
from tests.kernels.triton.common import Pool, edge_batch, run_step

pytestmark = pytest.mark.gpu

# attention: float32 the largest absolute error; half precision ``run_step``'s error in units of
# ``tests.kernels.triton.common.attention_bound`` (a spacing of the output plus the softmax weights'
# rounding), not an absolute 2e-3 / 2e-2 that outputs near 4 exceed by their rounding alone
DTYPES = [(torch.float32, 2e-5), (torch.float16, 1.0), (torch.bfloat16, 1.0)]


@pytest.fixture(autouse=True)
def _needs_cuda():
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"


def backend(**kw):
    from kernels.triton import TritonAttentionBackend, ops

    assert not ops.INTERPRETED, "TRITON_INTERPRET=1 is set: the kernels would not be compiled"
    return TritonAttentionBackend(**kw)


def test_triton_asked_for_on_cuda_is_compiled():
    chosen, why = select_backend("triton", torch.device("cuda"))
    assert chosen.name == "triton" and why == "attention backend: triton (asked for, compiled, in-place paged attention)"


# (block size, heads, KV heads): every block size and every GQA ratio (1, 2, 4, 8) in each dtype, paired
# off rather than their full product (each case compiles its own variants, a second or so each on a cold
# Triton cache: 60 cases took most of the device check's time)
MIXED = [(1, 4, 4), (5, 8, 4), (8, 8, 2), (16, 8, 1), (32, 16, 8)]


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("block_size,num_heads,kv_heads", MIXED)
def test_mixed_batches_on_cuda(dtype, tol, block_size, num_heads, kv_heads):
    rng = random.Random(block_size * 100 + num_heads * 10 + kv_heads)
    pool = Pool(600 if block_size == 1 else 200, block_size, kv_heads, 128, dtype=dtype, seed=rng.randint(0, 99),
                device="cuda")
    specs, tables = edge_batch(pool, num_decodes=6, num_prefills=3, rng=rng, max_blocks=90 // block_size + 1)
    worst, out = run_step(pool, specs, tables, num_heads, backend(), dtype=dtype)
    assert torch.isfinite(out).all() and worst <= tol, (specs, worst)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("head_dim", [40, 64, 80, 96, 128, 256])
def test_head_sizes_on_cuda(dtype, tol, head_dim):
    pool = Pool(60, 16, 2, head_dim, dtype=dtype, seed=head_dim, device="cuda")
    specs = [(1, 17), (1, 16), (30, 50), (40, 40)]
    worst, out = run_step(pool, specs, [pool.blocks(s) for _, s in specs], 8, backend(), dtype=dtype)
    assert torch.isfinite(out).all() and worst <= tol


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_split_kv_on_cuda(dtype, tol):
    pool = Pool(900, 16, 8, 128, dtype=dtype, seed=3, device="cuda")
    specs = [(1, 9000)] + [(1, n) for n in range(1, 64, 7)] + [(17, 3000)]
    tables = [pool.blocks(s) for _, s in specs]
    split = backend()
    worst, out = run_step(pool, specs, tables, 32, split, dtype=dtype)
    assert split.last_plan[0].num_splits > 1 and torch.isfinite(out).all() and worst <= tol


def _close(got, want, dtype):
    """Float32 2e-5; half precision two spacings relative (the kernels round where torch does, once or
    twice, their float32 math in between off by far less than a spacing), a subnormal spacing absolute."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    else:
        info = torch.finfo(dtype)
        torch.testing.assert_close(got.double(), want.double(), rtol=2 * info.eps, atol=info.tiny * info.eps)


@pytest.mark.parametrize("dtype", [dtype for dtype, _ in DTYPES])
def test_layer_ops_on_cuda(dtype):
    from kernels.triton import ops
    from tests.kernels.triton.common import ulp

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 256, generator=gen).to(dtype).cuda()
    res = torch.randn(9, 256, generator=gen).to(dtype).cuda()
    w = (1 + torch.randn(256, generator=gen) / 4).to(dtype).cuda()
    _close(ops.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6), dtype)
    want = fused_add_rms_norm(x.clone(), res.clone(), w, 1e-6)
    got = ops.fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)
    _close(got[0], want[0], dtype)
    g = torch.randn(5, 2 * 320, generator=gen).to(dtype).cuda()
    _close(ops.silu_and_mul(g), F.silu(g[:, :320]) * g[:, 320:], dtype)
    qkv = torch.randn(7, (8 + 2 * 2) * 64, generator=gen).to(dtype).cuda()
    q, k = qkv[:, :512], qkv[:, 512:640]
    q0, k0 = q.clone().reshape(7, 8, 64), k.clone().reshape(7, 2, 64)
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    freqs = torch.arange(100, dtype=torch.float32)[:, None] * inv[None, :]
    cache = torch.cat((freqs.cos(), freqs.sin()), -1).cuda()
    pos = torch.tensor([0, 1, 5, 99, 42, 7, 3]).cuda()
    want_q, want_k = apply_rotary_emb(q0, k0, pos, cache)
    ops.rotary_neox_(pos, q, k, cache, 64)
    # x1 cos - x2 sin can cancel: a spacing at |x1| + |x2| of the pair besides two at the result
    for got, want, x0 in ((q.reshape(7, 8, 64), want_q, q0), (k.reshape(7, 2, 64), want_k, k0)):
        pair = x0.double().abs()
        pair = torch.cat([pair[..., :32] + pair[..., 32:]] * 2, -1)
        if dtype == torch.float32:
            bound = 2e-5 * (1 + pair)
        else:
            bound = 2 * ulp(want, dtype) + ulp(pair, dtype)
        assert ((got.double() - want.double()).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [dtype for dtype, _ in DTYPES])
def test_batch_invariant_linear_on_cuda(dtype):
    """deterministic's linear, compiled (tl.dot): each row's bits whatever the rows beside it."""
    from kernels.triton.linear import BLOCK_M, linear_batch_invariant
    from tests.kernels.triton.common import ulp

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(384, 256, generator=gen).to(dtype)
    bias = torch.randn(384, generator=gen).to(dtype)
    x = torch.randn(4 * BLOCK_M + 3, 256, generator=gen).to(dtype)
    full = linear_batch_invariant(x.cuda(), weight.cuda(), bias.cuda()).cpu()
    # against float64: one rounding to the dtype, after a float32 sum of 256 exact products
    ref = F.linear(x.double(), weight.double(), bias.double())
    spread = F.linear(x.double().abs(), weight.double().abs(), bias.double().abs())
    assert ((full.double() - ref).abs() <= ulp(ref, dtype) + 256 * torch.finfo(torch.float32).eps * spread).all()
    x, weight, bias, full = x.cuda(), weight.cuda(), bias.cuda(), full.cuda()
    for start, rows in ((0, 1), (5, 3), (BLOCK_M - 1, 2), (7, 2 * BLOCK_M + 1), (0, x.shape[0])):
        assert torch.equal(linear_batch_invariant(x[start:start + rows], weight, bias), full[start:start + rows])
