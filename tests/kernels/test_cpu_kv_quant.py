"""The compiled CPU kernels on quantized KV pools (``kv_format``, ``kernels.kv_quant``): the store writes
exactly the bytes of ``kv_quant.quantize``, and the attention equals the same op run with format 0 on
the dequantized pool (float32): every path (decodes, a prefill chunk after a cached prefix, a fresh
prefill, the vector and scalar kernels, shared-prefix groups through the vector kernel and BLAS, sliding
window and soft-cap, fixed order), at several thread counts."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kernels import PagedAttentionMetadata, paged_attention
from kernels.kv_quant import FORMAT_IDS, dequantize, dequantize_pool, quantize
from tests.compiled import cpu_backend_or_skip
from tests.kernels.test_cpu_attention import Pool, plan_for, shared_batch
from tests.kernels.window_cases import with_threads
from tests.workers.test_models import checkpoint

__all__ = ["checkpoint"]  # the module-scoped checkpoint fixture (test_decoder_stack_on_quantized_pools)

CPU = cpu_backend_or_skip()
FORMATS = ["fp8_e4m3", "fp8_e5m2", "int8"]
NAN_SCALE = torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.uint8)  # a row's scale bytes: NaN


def quantized(pool: Pool, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``pool``'s K and V as quantized pools; the null block reads as NaN (scale NaN), so any read of
    padding poisons the output."""
    out = []
    for x in (pool.k, pool.v):
        q = quantize(x, fmt)
        q[0] = 0
        q[0, ..., -2:] = NAN_SCALE
        out.append(q)
    return out[0], out[1]


def step(pool, fmt, specs, tables, num_heads, cascade=None, dtype=torch.float32, window=0, softcap=0.0,
         deterministic=False, seed=1):
    """One step of ``specs`` ((query_len, seq_len) per sequence) on ``pool`` quantized as ``fmt``, the
    query tokens' rows of the pool overwritten with junk first (the op's store must write them) ->
    (the op's output, format 0's output over the dequantized pool in float32, the quantized K pool)."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads, head_dim = pool.k.shape[2], pool.k.shape[3]

    def meta_for(kv_format):
        meta = PagedAttentionMetadata.build([q for q, _ in specs], [s for _, s in specs], tables, pool.block_size,
                                            backend=CPU, deterministic=deterministic, kv_format=kv_format)
        meta.cascade = cascade
        return meta

    meta = meta_for(fmt)
    num_tokens = sum(q for q, _ in specs)
    qkv = torch.randn(num_tokens, num_heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    query = qkv[:, :num_heads]  # strided, as the model's qkv split makes it
    key = torch.cat([pool.context(t, s)[0][s - q:] for (q, s), t in zip(specs, tables)]).to(dtype)
    value = torch.cat([pool.context(t, s)[1][s - q:] for (q, s), t in zip(specs, tables)]).to(dtype)
    k_pool, v_pool = quantized(pool, fmt)
    for p in (k_pool, v_pool):
        p.view(-1, kv_heads, head_dim + 2)[meta.slot_mapping] = torch.randint(
            0, 256, (num_tokens, kv_heads, head_dim + 2), generator=gen, dtype=torch.uint8)
    scale = 1 / math.sqrt(head_dim)
    out = paged_attention(query, key, value, k_pool, v_pool, meta, scale, window=window, softcap=softcap)
    # the store put the step's rows back as ``quantize`` writes them (the junk is gone)
    assert torch.equal(k_pool.view(-1, kv_heads, head_dim + 2)[meta.slot_mapping], quantize(key, fmt))
    assert torch.equal(v_pool.view(-1, kv_heads, head_dim + 2)[meta.slot_mapping], quantize(value, fmt))
    k_deq, v_deq = dequantize_pool(k_pool, fmt, torch.float32), dequantize_pool(v_pool, fmt, torch.float32)
    rows = meta.slot_mapping
    want = paged_attention(query.float(), k_deq.view(-1, kv_heads, head_dim)[rows],
                           v_deq.view(-1, kv_heads, head_dim)[rows], k_deq, v_deq, meta_for("auto"), scale,
                           window=window, softcap=softcap)
    return out, want, k_pool


def mixed_batch(pool):
    """Decodes (one on a block edge), a prefill chunk after a cached prefix of several blocks, a fresh
    prefill."""
    bs = pool.block_size
    specs = [(1, 37), (1, 3 * bs), (1, 2), (13, 4 * bs + 5 + 13), (21, 21)]
    return specs, [pool.blocks(s) for _, s in specs]


def assert_same(out, want, dtype=torch.float32):
    """float32: the same bits as format 0 on the dequantized pool (the same float math on the same
    values); half types: that output rounded once."""
    assert torch.isfinite(out).all()
    assert torch.equal(out, want.to(dtype)), (out.double() - want.double()).abs().max().item()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_writes_the_bytes_of_quantize(fmt, dtype):
    gen = torch.Generator().manual_seed(FORMAT_IDS[fmt])
    bs, kv_heads, head_dim, heads, tokens = 16, 2, 64, 4, 40
    k_pool = torch.randint(0, 256, (8, bs, kv_heads, head_dim + 2), generator=gen, dtype=torch.uint8)
    v_pool = torch.randint(0, 256, (8, bs, kv_heads, head_dim + 2), generator=gen, dtype=torch.uint8)
    before_k, before_v = k_pool.clone(), v_pool.clone()
    magnitudes = 10.0 ** torch.empty(tokens, kv_heads, 1).uniform_(-4, 4, generator=gen)
    key = torch.randn(tokens, kv_heads, head_dim, generator=gen) * magnitudes
    value = torch.randn(tokens, kv_heads, head_dim, generator=gen) * magnitudes
    key[0, 0] = 0  # a row of zeros: scale 1, codes 0
    value[1, 1] = 0
    key[2, 1] *= 1e30  # large magnitudes (bfloat16 and float32 hold them; float16 saturates below)
    value[3, 0] = -3e38 if dtype != torch.float16 else -65504
    key[4, 0, 7] = 1e4  # one large value among small ones: the others round to zero codes
    value[5, 1] = 1e-30
    if dtype == torch.float32:  # amax / qmax rounds to 0 in bfloat16: scale 1 (a scale of 0 would be NaN codes)
        key[6, 0] = torch.linspace(-1e-39, 1e-39, head_dim)
        value[6, 1] = 2e-36
    key, value = key.to(dtype), value.to(dtype)
    if dtype == torch.float16:
        key, value = key.nan_to_num(posinf=65504, neginf=-65504), value.nan_to_num(posinf=65504, neginf=-65504)
    tables = [[3, 1, 6], [2, 7]]
    specs = [(30, 40), (10, 10)]  # the first sequence's cached prefix stays as it was
    meta = PagedAttentionMetadata.build([q for q, _ in specs], [s for _, s in specs], tables, bs, backend=CPU,
                                        kv_format=fmt)
    query = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    paged_attention(query, key, value, k_pool, v_pool, meta, 0.125)
    slots = meta.slot_mapping
    assert torch.equal(k_pool.view(-1, kv_heads, head_dim + 2)[slots], quantize(key, fmt))
    assert torch.equal(v_pool.view(-1, kv_heads, head_dim + 2)[slots], quantize(value, fmt))
    untouched = torch.ones(8 * bs, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(k_pool.view(8 * bs, -1)[untouched], before_k.view(8 * bs, -1)[untouched])
    assert torch.equal(v_pool.view(8 * bs, -1)[untouched], before_v.view(8 * bs, -1)[untouched])


# head sizes on the vector kernel (64, 128, 256) and on the scalar one (40 with 16 lanes, 36 with 8 or 16);
# grouped-query ratios 4 (decodes on the row-vectorised path) and 2 (decodes on the few-rows path)
# head sizes the vector kernel has no compiled width for (48, 192: vectors counted at run time) beside
# those it has and those only the scalar kernel takes (40, 36 on AVX-512)
SHAPES = [(hd, bs, 8, 2) for hd in (64, 128, 256, 40, 36, 48, 192) for bs in (16, 5)] + [(64, 16, 2, 1), (40, 5, 2, 1)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_dim,block_size,num_heads,kv_heads", SHAPES)
def test_attention_equals_format_0_on_the_dequantized_pool(fmt, head_dim, block_size, num_heads, kv_heads):
    pool = Pool(60, block_size, kv_heads, head_dim, seed=head_dim + block_size)
    specs, tables = mixed_batch(pool)
    out, want, _ = step(pool, fmt, specs, tables, num_heads)
    assert_same(out, want)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_type_queries(fmt, dtype):
    """bfloat16 / float16 query and K/V: the float32 math of format 0 on the dequantized pool, its
    output rounded once to the query's dtype."""
    pool = Pool(60, 16, 2, 64, seed=5)
    specs, tables = mixed_batch(pool)
    out, want, _ = step(pool, fmt, specs, tables, 8, dtype=dtype)
    assert out.dtype == dtype
    assert_same(out, want, dtype)


# bfloat16 scales for test_every_code_dequantizes_to_its_value: 1, powers of two, values that round,
# a subnormal, the largest kv_quant writes (bfloat16(FLT_MAX / 448)) and one past it whose 256 * scale
# overflows (e4m3's vector path then multiplies twice)
CODE_SCALES = [1.0, 2.0 ** -10, 3.0, 0.1, 1e-39, float(torch.tensor(3.4028235e38 / 448).bfloat16()), 2.0 ** 121]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_dim,kv_heads", [(256, 1), (128, 2), (40, 7), (36, 8)])
def test_every_code_dequantizes_to_its_value(fmt, head_dim, kv_heads):
    """All 256 codes of the format, in the cached V row of a decode under several scales, come out of the
    kernel to the bit as kv_quant.dequantize gives them: the cached key outscores the step's own by over
    100 (its weight exp(-d) is exactly 0), so the output is (1 * v + 0 * v_new) / 1 = v to the bit, but
    for a zero's sign (the accumulator starts at +0: zeros are compared as +0). Head sizes on the
    vector path's full vectors (256, 128) and with a scalar tail (40, 36). The NaN codes (e4m3fn's
    0x7f / 0xff, e5m2's 0x7d-0x7f / 0xfd-0xff), which the store never writes: e5m2's read as NaN,
    e4m3fn's as anything."""
    bs = 4
    codes = (torch.arange(kv_heads * head_dim) % 256).to(torch.uint8).view(kv_heads, head_dim)
    meta = PagedAttentionMetadata.build([1], [2], [[1]], bs, backend=CPU, kv_format=fmt)
    query = torch.full((1, kv_heads, head_dim), 4.0)
    key = torch.full((1, kv_heads, head_dim), -1.0)
    value = torch.full((1, kv_heads, head_dim), -1.0)
    k_pool = quantize(torch.ones(2, bs, kv_heads, head_dim), fmt)
    k_pool[0] = 0
    k_pool[0, ..., -2:] = NAN_SCALE
    nan_codes = {"fp8_e4m3": [0x7f, 0xff], "fp8_e5m2": [0x7d, 0x7e, 0x7f, 0xfd, 0xfe, 0xff], "int8": []}[fmt]
    nan_code = torch.isin(codes, torch.tensor(nan_codes, dtype=torch.uint8))
    for scale in CODE_SCALES:
        v_pool = k_pool.clone()
        v_pool[1, 0, :, :head_dim] = codes
        v_pool[1, 0, :, head_dim:] = torch.tensor([scale], dtype=torch.bfloat16).view(torch.uint8)
        out_all = out = paged_attention(query, key, value, k_pool, v_pool, meta, 1.0)[0]
        want = dequantize(v_pool[1, 0], fmt)
        out, want = (torch.where(x == 0, 0.0, x)[~nan_code] for x in (out, want))
        assert torch.equal(out.view(torch.int32), want.view(torch.int32)), scale
        if fmt == "fp8_e5m2":
            assert out_all[nan_code].isnan().all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("threads", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [128, 40])
def test_attention_at_thread_counts(fmt, threads, head_dim):
    pool = Pool(200, 12, 2, head_dim, seed=threads)
    rng = random.Random(threads)
    specs = [(1, rng.randint(1, 100)) for _ in range(6)] + [(30, 30 + 12 * 3 + 7), (40, 40), (9, 64)]
    tables = [pool.blocks(s) for _, s in specs]
    out, want, _ = with_threads(threads, lambda: step(pool, fmt, specs, tables, 8))
    assert_same(out, want)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("num_heads,kv_heads,head_dim", [(8, 2, 64), (8, 1, 40)])
def test_shared_prefix_groups(fmt, num_heads, kv_heads, head_dim):
    """Groups on the vector kernel (small) and through BLAS (604 shared tokens, two key chunks of 512 and
    92, and 12 decodes plus two prefill chunks: rows enough per KV head), then each member's suffix merged."""
    pool = Pool(1000, 4, kv_heads, head_dim, seed=3)
    rng = random.Random(7)
    members = [(1, 604 + rng.randint(1, 36)) for _ in range(12)] + [(5, 640), (6, 700)]
    specs, tables = shared_batch(pool, [(604, members), (40, [(1, 41), (2, 57)])], extra=[(5, 9), (1, 30)])
    cascade = plan_for(specs, tables, 4)
    assert cascade is not None and sorted(cascade.lens.tolist()) == [40, 604]
    for threads in (1, 2):
        out, want, _ = with_threads(threads, lambda: step(pool, fmt, specs, tables, num_heads, cascade=cascade))
        assert torch.isfinite(out).all()
        # the same bits here (BLAS runs the same products on the same dequantized values); a few ulps
        # allowed, as an sgemm may pick its kernel by its buffers' alignment
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_dim", [64, 40])
def test_window_and_softcap(fmt, head_dim):
    pool = Pool(300, 5, 2, head_dim, seed=11)
    # members whose windows reach into the 40 shared keys and members whose windows do not
    specs, tables = shared_batch(pool, [(40, [(1, 48), (1, 70), (1, 41), (7, 60)])],
                                 extra=[(1, 37), (13, 40), (25, 25)])
    cascade = plan_for(specs, tables, 5)
    assert cascade is not None and cascade.lens.tolist() == [40]
    for groups in (None, cascade):
        for window, softcap in ((16, 0.0), (0, 5.0), (9, 3.0)):
            out, want, _ = step(pool, fmt, specs, tables, 8, cascade=groups, window=window, softcap=softcap)
            assert_same(out, want)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (4, 1, 128)])
def test_fixed_order_decode_equals_prefill(fmt, heads, kv_heads, head_dim):
    """One sequence of 75 tokens as one prefill, in chunks of 7 and token by token, each step beside a
    different set of other sequences: in fixed order every token's output has the same bits."""
    gen = torch.Generator().manual_seed(head_dim)
    block_size, length = 16, 75
    k_pool = torch.zeros(64, block_size, kv_heads, head_dim + 2, dtype=torch.uint8)
    v_pool = torch.zeros_like(k_pool)
    q = torch.randn(length, heads, head_dim, generator=gen)
    k = torch.randn(length, kv_heads, head_dim, generator=gen)
    v = torch.randn(length, kv_heads, head_dim, generator=gen)
    table = list(range(1, 6))
    rng = random.Random(head_dim)
    others = [(rng.randint(1, 40), rng.randint(41, 120)) for _ in range(5)]
    other_tables = [list(range(6 + 8 * i, 14 + 8 * i)) for i in range(len(others))]

    def chunk(start, end, count):
        """Tokens [start, end) after `count` other sequences (their decodes first, as a step is ordered)."""
        entries = [((end - start, end), table, q[start:end], k[start:end], v[start:end], True)]
        for (ql, sl), t in zip(others[:count], other_tables):
            entries.append(((ql, sl), t, torch.randn(ql, heads, head_dim, generator=gen),
                            torch.randn(ql, kv_heads, head_dim, generator=gen),
                            torch.randn(ql, kv_heads, head_dim, generator=gen), False))
        entries.sort(key=lambda e: e[0][0] != 1)
        meta = PagedAttentionMetadata.build([e[0][0] for e in entries], [e[0][1] for e in entries],
                                            [e[1] for e in entries], block_size, backend=CPU, deterministic=True,
                                            kv_format=fmt)
        out = paged_attention(torch.cat([e[2] for e in entries]), torch.cat([e[3] for e in entries]),
                              torch.cat([e[4] for e in entries]), k_pool, v_pool, meta, 1 / math.sqrt(head_dim))
        begin = sum(e[0][0] for e in entries[:[e[5] for e in entries].index(True)])
        return out[begin:begin + end - start]

    def by_chunks(size):
        return torch.cat([chunk(s, min(s + size, length), (s // size) % (len(others) + 1))
                          for s in range(0, length, size)])

    prefill = by_chunks(length)
    assert torch.isfinite(prefill).all()
    for size in (7, 1):
        assert torch.equal(by_chunks(size), prefill), f"chunks of {size} differ from one prefill"
    assert torch.equal(with_threads(3, lambda: by_chunks(7)), prefill)


@pytest.mark.parametrize("width_change", [-1, 1, -2])
def test_a_pool_of_the_wrong_width_is_refused(width_change):
    pool = Pool(20, 16, 2, 64)
    specs = [(1, 20), (5, 5)]
    tables = [pool.blocks(s) for _, s in specs]
    k_pool = torch.randint(0, 256, (20, 16, 2, 66 + width_change), dtype=torch.uint8)
    v_pool = torch.randint(0, 256, (20, 16, 2, 66 + width_change), dtype=torch.uint8)
    before = k_pool.clone(), v_pool.clone()
    meta = PagedAttentionMetadata.build([q for q, _ in specs], [s for _, s in specs], tables, 16, backend=CPU,
                                        kv_format="int8")
    x = torch.randn(6, 2, 64)
    with pytest.raises(RuntimeError, match=r"must be uint8 \[blocks, block_size, kv_heads, head_dim \+ 2\]"):
        paged_attention(torch.randn(6, 8, 64), x, x, k_pool, v_pool, meta, 0.125)
    assert torch.equal(k_pool, before[0]) and torch.equal(v_pool, before[1])


def test_a_model_dtype_pool_is_refused_under_a_quantized_format():
    pool = Pool(20, 16, 2, 64)
    meta = PagedAttentionMetadata.build([3], [3], [pool.blocks(3)], 16, backend=CPU, kv_format="fp8_e4m3")
    before = pool.k.nan_to_num(), pool.v.nan_to_num()
    with pytest.raises(RuntimeError, match="must be uint8"):
        paged_attention(torch.randn(3, 4, 64), torch.randn(3, 2, 64), torch.randn(3, 2, 64), pool.k, pool.v, meta, 1.0)
    assert torch.equal(pool.k.nan_to_num(), before[0]) and torch.equal(pool.v.nan_to_num(), before[1])


def test_an_unknown_format_id_is_refused():
    k_pool = torch.zeros(4, 16, 2, 66, dtype=torch.uint8)
    meta = PagedAttentionMetadata.build([1], [1], [[1]], 16, backend=CPU)
    args = CPU.metadata_args(meta)
    with pytest.raises(RuntimeError, match="kv_format must be"):
        CPU.ops.paged_attention(torch.randn(1, 4, 64), torch.randn(1, 2, 64), torch.randn(1, 2, 64), k_pool,
                                k_pool.clone(), *args, 1.0, False, 0, 0.0, 4)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8"])
def test_decoder_stack_on_quantized_pools(fmt, checkpoint):
    """The whole Llama stack in one call (``decoder_stack``, which passes kv_format to each layer's
    attention) against the same model layer by layer (the backend's ``forward``), both on quantized
    pools: the same logits and the same pool bytes, to the bit, through prefill, decodes and a step
    with a shared-prefix group."""
    from kernels import CascadeGroups
    from tests.workers.test_decoder_stack import _model
    from tests.workers.test_models import BLOCK_SIZE, NUM_BLOCKS, Paging
    from workers.models import kv_cache_shape

    ckpt = checkpoint("llama")

    def run(stack):
        model = _model(ckpt, stack)
        num_layers, kv_heads, head_dim, _ = kv_cache_shape(ckpt.hf_config, 1)
        pools = [tuple(torch.zeros(NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim + 2, dtype=torch.uint8) for _ in "kv")
                 for _ in range(num_layers)]
        paging, logits = Paging(), []

        def step(*chunks, groups=None):
            ids, positions, meta = paging.step(list(chunks))
            meta.backend, meta.cascade, meta.kv_format = CPU, groups, fmt
            logits.append(model.compute_logits(model(ids, positions, pools, meta)))

        step(("A", 0, 37), ("B", 0, 13))
        for p in range(37, 40):
            step(("A", p, 1))
        paging.share_prefix("C", "A", 16)
        shared = torch.tensor([paging.tables["A"][:2]], dtype=torch.int32)
        int32 = dict(dtype=torch.int32)
        step(("A", 40, 1), ("B", 13, 1), ("C", 16, 7),
             groups=CascadeGroups(torch.tensor([16, 0, 16], **int32), shared, torch.tensor([16], **int32),
                                  torch.tensor([0, 2], **int32), torch.tensor([0, 2], **int32)))
        return logits, pools

    with torch.inference_mode():
        (stacked, stacked_pools), (layered, layered_pools) = run(True), run(False)
    for got, want in zip(stacked, layered, strict=True):
        assert torch.isfinite(got).all() and torch.equal(got, want)
    for got, want in zip(stacked_pools, layered_pools, strict=True):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert any(bool(p[0].any()) for p in stacked_pools)
