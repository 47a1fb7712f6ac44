"""The Triton KV store and paged attention over quantized pools (``kernels.kv_quant``), under the
interpreter. The store writes exactly the bytes of ``kernels.kv_quant.quantize``; the attention reads
the codes and scales in place, and its output is held to the same kernel with format 0 run over the
pool dequantized to float32 (``dequantize_pool``): the keys and values it reads are those values exactly
(a code times a bfloat16 scale is exact in float32), so in float32 the two are the same bits, and in
bfloat16 they differ by the output's rounding (the interpreter truncates to bfloat16: measured 0.99994 of
a spacing at most; held to one spacing plus 1e-5). float16 runs tl.dot here, over keys and values rounded
to float16 (``within``). The pool's null block holds 0xFF bytes (NaN codes and scale in float8): any read of
padding would poison the output."""

from __future__ import annotations

import pytest
import torch

from kernels import PagedAttentionMetadata, paged_attention
from kernels.kv_quant import FORMAT_IDS, dequantize_pool, quantize
from kernels.triton import TritonAttentionBackend, ops
from tests.kernels.triton.common import Pool, ulp

FORMATS = ("fp8_e4m3", "fp8_e5m2", "int8")


def quantized(pool: Pool, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``pool``'s K and V as pools of ``fmt`` (its null block 0xFF bytes)."""
    k, v = quantize(pool.k, fmt), quantize(pool.v, fmt)
    k[0] = v[0] = 0xFF
    return k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_store_writes_the_bytes_of_quantize(fmt, dtype):
    """Rows over ten decades of magnitude, an all-zero row, a row of -0.0 and tiny values (codes that
    underflow keep their sign), ties of the int8 rounding; a strided key/value as the qkv split makes them;
    a negative slot is skipped."""
    gen = torch.Generator().manual_seed(FORMAT_IDS[fmt])
    tokens, heads, d = 9, 3, 40  # a head size that pads (40 -> 64)
    kv = torch.randn(tokens, 3, heads, d, generator=gen) * torch.logspace(-5, 5, tokens)[:, None, None, None]
    kv[2, 0, 1] = 0.0
    kv[3, 2, 0] = -0.0
    kv[4, 0, 0, :5] = 1e-30
    if dtype == torch.float32:  # amax / qmax rounds to 0 in bfloat16: scale 1 (a scale of 0 would be NaN codes)
        kv[6, 0, 1] = torch.linspace(-1e-39, 1e-39, d)
        kv[6, 2, 0] = 2e-36
    kv[5, 2, 2] = (torch.arange(d) - d / 2 + 0.5) / 128  # scale 1/128 exactly: int8's x / scale at halves (ties)
    kv[5, 2, 2, 0] = 127 / 128
    kv = kv.to(dtype)
    key, value = kv[:, 0], kv[:, 2]
    k_pool = torch.full((4, 5, heads, d + 2), 0xAB, dtype=torch.uint8)
    v_pool = torch.full_like(k_pool, 0xAB)
    slots = torch.tensor([0, 1, 2, 5, 6, 7, 8, -1, 11])
    ops.store_kv(key, value, k_pool, v_pool, slots, FORMAT_IDS[fmt])
    written = slots >= 0
    for pool, x in ((k_pool, key), (v_pool, value)):
        flat = pool.view(-1, heads, d + 2)
        assert torch.equal(flat[slots[written]], quantize(x[written], fmt))
        others = torch.ones(flat.shape[0], dtype=torch.bool)
        others[slots[written]] = False
        assert (flat[others] == 0xAB).all()  # nothing else written (the skipped token's row included)
    assert torch.equal(k_pool.view(-1, heads, d + 2)[2, 1, d:], torch.tensor([0x80, 0x3F], dtype=torch.uint8))


def run_both(pool: Pool, fmt: str, specs, tables, num_heads, backend, dtype=torch.float32, seed=1, window=0,
             softcap=0.0, deterministic=False, query=None):
    """One step over ``pool`` quantized to ``fmt``, its new tokens' rows overwritten with 0xFF first
    (only the kernel's store puts them back): the output, and that of format 0 over the pool after the
    store dequantized to float32 (a float32 query: the bfloat16 one's values)."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads, head_dim = pool.k.shape[2], pool.k.shape[3]
    k_pool, v_pool = quantized(pool, fmt)
    lens = dict(query_lens=[q for q, _ in specs], seq_lens=[s for _, s in specs])
    meta = PagedAttentionMetadata.build(lens["query_lens"], lens["seq_lens"], tables, pool.block_size,
                                        backend=backend, deterministic=deterministic, kv_format=fmt)
    num_tokens = sum(q for q, _ in specs)
    qkv = torch.randn(num_tokens, num_heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    query = qkv[:, :num_heads] if query is None else query
    contexts = [pool.context(t, s) for (_, s), t in zip(specs, tables)]
    key = torch.cat([k[s - q:] for (q, s), (k, _) in zip(specs, contexts)]).to(dtype)
    value = torch.cat([v[s - q:] for (q, s), (_, v) in zip(specs, contexts)]).to(dtype)
    flat = k_pool.shape[0] * pool.block_size
    k_pool.view(flat, kv_heads, -1)[meta.slot_mapping] = 0xFF
    v_pool.view(flat, kv_heads, -1)[meta.slot_mapping] = 0xFF
    scale = head_dim ** -0.5
    out = paged_attention(query, key, value, k_pool, v_pool, meta, scale, window=window, softcap=softcap)
    # the store wrote the step's rows as ``quantize`` does
    assert torch.equal(k_pool.view(flat, kv_heads, -1)[meta.slot_mapping], quantize(key, fmt))
    assert torch.equal(v_pool.view(flat, kv_heads, -1)[meta.slot_mapping], quantize(value, fmt))
    k_ref, v_ref = dequantize_pool(k_pool, fmt, torch.float32), dequantize_pool(v_pool, fmt, torch.float32)
    ref_meta = PagedAttentionMetadata.build(lens["query_lens"], lens["seq_lens"], tables, pool.block_size,
                                            backend=backend, deterministic=deterministic)  # the same plan
    ref = paged_attention(query.float(), k_ref.view(flat, kv_heads, -1)[meta.slot_mapping],
                          v_ref.view(flat, kv_heads, -1)[meta.slot_mapping], k_ref, v_ref, ref_meta, scale,
                          window=window, softcap=softcap)
    return out, ref


def within(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest difference over its tolerance (at most 1 passes). float32: none (the same bits);
    bfloat16 (the sums path: float32 keys and values): one spacing of the output plus 1e-5; float16 (tl.dot
    here, on the keys, values and weights rounded to float16): one spacing plus 4 eps (1 + |ref|)."""
    err = (out.double() - ref.double()).abs()
    if out.dtype == torch.float32:
        return 0.0 if torch.equal(out, ref) else float("inf")
    tol = ulp(ref, out.dtype) + (1e-5 if out.dtype == torch.bfloat16
                                 else 4 * torch.finfo(out.dtype).eps * (1 + ref.double().abs()))
    return (err / tol).max().item()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_dim,block_size,num_heads,kv_heads,dtype", [
    (64, 16, 8, 2, torch.float32),
    (128, 5, 4, 1, torch.float32),
    (64, 5, 6, 2, torch.bfloat16),
])
def test_mixed_batch_matches_format_0_over_the_dequantized_pool(fmt, head_dim, block_size, num_heads, kv_heads,
                                                                  dtype):
    """Decodes (one split over its keys), a prefill chunk after a cached prefix of several blocks, and a
    fresh prefill; grouped-query heads."""
    pool = Pool(40, block_size, kv_heads, head_dim, seed=head_dim + block_size)
    specs = [(1, 70), (1, 3), (9, 41), (12, 12)]
    tables = [pool.blocks(s) for _, s in specs]
    backend = TritonAttentionBackend(block_n=16, target_programs=64, min_split_tiles=1)
    out, ref = run_both(pool, fmt, specs, tables, num_heads, backend, dtype)
    assert backend.last_plan[0].num_splits > 1  # the decodes' keys are split and merged
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert within(out, ref) <= 1.0


def test_float16_model():
    """float16 takes tl.dot under the interpreter: the dequantized keys and values are rounded to float16 for
    it (as the compiled path does for both half dtypes), so the result moves by more than the output's
    rounding (measured: 1.2e-3 absolute at most, a third of the tolerance)."""
    pool = Pool(40, 5, 2, 64, seed=69)
    specs = [(1, 70), (1, 3), (9, 41), (12, 12)]
    backend = TritonAttentionBackend(block_n=16, target_programs=64, min_split_tiles=1)
    out, ref = run_both(pool, "int8", specs, [pool.blocks(s) for _, s in specs], 6, backend, torch.float16)
    assert out.dtype == torch.float16 and torch.isfinite(out).all() and within(out, ref) <= 1.0


def test_head_size_256():
    pool = Pool(12, 16, 1, 256, seed=4)
    specs = [(1, 33), (5, 20)]
    out, ref = run_both(pool, "fp8_e4m3", specs, [pool.blocks(s) for _, s in specs], 2, TritonAttentionBackend())
    assert torch.isfinite(out).all() and within(out, ref) <= 1.0


@pytest.mark.parametrize("fmt", ["fp8_e5m2", "int8"])
def test_sliding_window_and_softcap(fmt):
    pool = Pool(40, 5, 2, 64, seed=11)
    specs = [(1, 47), (1, 9), (9, 38), (14, 14)]
    tables = [pool.blocks(s) for _, s in specs]
    backend = TritonAttentionBackend(block_n=16, target_programs=64, min_split_tiles=1)
    out, ref = run_both(pool, fmt, specs, tables, 4, backend, window=11, softcap=4.0)
    assert torch.isfinite(out).all() and within(out, ref) <= 1.0


def test_deterministic_token_bits_the_same_in_a_decode_and_in_a_chunk():
    """The same token (position 40 of a sequence) as a decode and as the last row of a 20-token chunk,
    beside another sequence's decode: the same bits, both matching format 0 over the dequantized pool."""
    pool = Pool(30, 8, 2, 64, seed=6)
    table, other = pool.blocks(41), pool.blocks(17)
    backend = TritonAttentionBackend()
    q = torch.randn(21, 4, 64, generator=torch.Generator().manual_seed(3))
    decode, ref_decode = run_both(pool, "fp8_e4m3", [(1, 17), (1, 41)], [other, table], 4, backend,
                                  deterministic=True, query=q[[0, 20]])
    chunk, ref_chunk = run_both(pool, "fp8_e4m3", [(1, 17), (20, 41)], [other, table], 4, backend,
                                deterministic=True, query=q)
    assert torch.equal(decode[-1], chunk[-1])
    assert within(decode, ref_decode) <= 1.0 and within(chunk, ref_chunk) <= 1.0
