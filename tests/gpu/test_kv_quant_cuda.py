"""Quantized KV pools on the compiled Triton kernels (CUDA): the store writes the bytes of
``kernels.kv_quant.quantize`` (computed on the CPU, the contract), and attention over a quantized pool
gives what format 0 gives over the same pool dequantized, in the same plan."""

from __future__ import annotations

import pytest
import torch

from kernels import PagedAttentionMetadata, paged_attention
from kernels.kv_quant import FORMAT_IDS, dequantize_pool, quantize

pytestmark = pytest.mark.gpu
FORMATS = ("fp8_e4m3", "fp8_e5m2", "int8")


@pytest.fixture(autouse=True)
def _needs_cuda():
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"


def backend():
    from kernels.triton import TritonAttentionBackend, ops

    assert not ops.INTERPRETED, "TRITON_INTERPRET=1 is set: the kernels would not be compiled"
    return TritonAttentionBackend()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_store_writes_the_bytes_of_quantize_on_cuda(fmt, dtype):
    from kernels.triton import ops

    gen = torch.Generator().manual_seed(FORMAT_IDS[fmt])
    tokens, heads, d = 33, 4, 128
    kv = (torch.randn(2, tokens, heads, d, generator=gen) * torch.logspace(-4, 4, tokens)[None, :, None, None])
    kv[0, 3, 1] = 0.0
    kv = kv.to(dtype)
    k_pool = torch.full((8, 16, heads, d + 2), 0xAB, dtype=torch.uint8, device="cuda")
    v_pool = torch.full_like(k_pool, 0xAB)
    slots = torch.randperm(8 * 16, generator=gen)[:tokens]
    ops.store_kv(kv[0].cuda(), kv[1].cuda(), k_pool, v_pool, slots.cuda(), FORMAT_IDS[fmt])
    for pool, x in ((k_pool, kv[0]), (v_pool, kv[1])):
        assert torch.equal(pool.view(-1, heads, d + 2)[slots.cuda()].cpu(), quantize(x, fmt))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_attention_over_a_quantized_pool_on_cuda(fmt, dtype, tol):
    """Decodes, a chunk after a cached prefix of several blocks and a fresh prefill, GQA 4; the
    reference is format 0 in float32 over the dequantized pool after the store."""
    gen = torch.Generator().manual_seed(7)
    num_blocks, bs, kv_heads, heads, d = 64, 16, 2, 8, 128
    pool_k = quantize(torch.randn(num_blocks, bs, kv_heads, d, generator=gen), fmt).cuda()
    pool_v = quantize(torch.randn(num_blocks, bs, kv_heads, d, generator=gen), fmt).cuda()
    pool_k[0] = pool_v[0] = 0xFF  # the null block: NaN scales, so a padding read shows
    specs = [(1, 70), (1, 17), (20, 90), (33, 33)]
    order = torch.randperm(num_blocks - 1, generator=gen).add(1).tolist()
    tables = [[order.pop() for _ in range(-(-s // bs))] for _, s in specs]
    qlens, slens = [q for q, _ in specs], [s for _, s in specs]
    chosen = backend()
    meta = PagedAttentionMetadata.build(qlens, slens, tables, bs, device="cuda", backend=chosen, kv_format=fmt)
    tokens = sum(qlens)
    query = torch.randn(tokens, heads, d, generator=gen).to(dtype).cuda()
    key = torch.randn(tokens, kv_heads, d, generator=gen).to(dtype).cuda()
    value = torch.randn(tokens, kv_heads, d, generator=gen).to(dtype).cuda()
    out = paged_attention(query, key, value, pool_k, pool_v, meta, d ** -0.5)
    flat = num_blocks * bs
    k_ref, v_ref = dequantize_pool(pool_k, fmt, torch.float32), dequantize_pool(pool_v, fmt, torch.float32)
    ref_meta = PagedAttentionMetadata.build(qlens, slens, tables, bs, device="cuda", backend=chosen)
    ref = paged_attention(query.float(), k_ref.view(flat, kv_heads, d)[meta.slot_mapping],
                          v_ref.view(flat, kv_heads, d)[meta.slot_mapping], k_ref, v_ref, ref_meta, d ** -0.5)
    assert torch.isfinite(out).all()
    assert (out.float() - ref).abs().max().item() <= tol
