"""The compiled CPU kernels in fixed order (the engine's ``deterministic``): a row's bits depend on
nothing but its own inputs: not the number of rows beside it, its place among them, the thread
count, nor (attention) whether its token is computed in a decode step or in a prefill chunk."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kernels import PagedAttentionMetadata, paged_attention
from tests.compiled import cpu_backend_or_skip
from workers.layers.kernels import _transposed_layout

CPU = cpu_backend_or_skip()
OPS = CPU.layer_ops

# (in, out, bias) of every linear layer of the test checkpoints: tiny and small llama / qwen2 (qkv
# with bias), opt's tiny projections, and the LM heads
SHAPES = [
    (64, 128, False), (64, 128, True), (64, 64, False), (64, 256, False), (128, 64, False), (64, 4096, False),
    (64, 256, True), (256, 64, True),
    (512, 768, True), (512, 512, False), (512, 2816, False), (1408, 512, False), (512, 4096, False),
    (64, 72, True),  # columns past a multiple of 16
]
ROWS = [1, 2, 3, 4, 5, 7, 16, 17, 33, 64, 191, 192, 255, 513, 700]


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("k,n,bias", SHAPES)
def test_fixed_order_linear_rows_do_not_depend_on_the_batch(k, n, bias, num_threads, threads):
    threads(num_threads)
    gen = torch.Generator().manual_seed(k * n)
    weight = _transposed_layout(torch.randn(n, k, generator=gen))
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(max(ROWS), k, generator=gen)
    alone = OPS.linear_fixed_order(x[:1], weight, b)
    torch.testing.assert_close(alone, torch.nn.functional.linear(x[:1], weight, b), rtol=1e-4, atol=1e-4)
    for m in ROWS:
        out = OPS.linear_fixed_order(x[:m], weight, b)
        assert torch.equal(out[0], alone[0]), f"row 0 of {m} rows differs"
        # the same row last in the batch (another place in the 4-row tiles)
        moved = OPS.linear_fixed_order(torch.cat([x[1:m], x[:1]]), weight, b)
        assert torch.equal(moved[-1], alone[0]), f"row {m - 1} of {m} rows differs"


def test_fixed_order_linear_takes_any_weight_layout():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(80, 48, generator=gen)  # [out, in] contiguous: not the BLAS layout
    x = torch.randn(9, 48, generator=gen)
    expected = OPS.linear_fixed_order(x, _transposed_layout(weight), None)
    assert torch.equal(OPS.linear_fixed_order(x, weight, None), expected)
    assert torch.equal(OPS.linear_fixed_order(x.view(3, 3, 48), weight, None).view(9, 80), expected)
    with pytest.raises(RuntimeError, match="float32"):
        OPS.linear_fixed_order(x.double(), weight.double(), None)


def attend(pool_k, pool_v, block_size, specs, tables, queries, keys, values, deterministic):
    """specs: (query_len, seq_len) per sequence; queries/keys/values: per sequence, its query tokens."""
    meta = PagedAttentionMetadata.build([q for q, _ in specs], [s for _, s in specs], tables, block_size,
                                        backend=CPU, deterministic=deterministic)
    return paged_attention(torch.cat(queries), torch.cat(keys), torch.cat(values), pool_k, pool_v, meta,
                           1 / math.sqrt(queries[0].shape[-1]))


# head sizes 128 and 80 too: a decode's scores take two keys at a time where both rows fit in the registers
# (float_key_scores), a prefill's rows the general loop, in the same order
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (8, 2, 64), (4, 4, 32), (8, 1, 64), (4, 1, 128),
                                                     (6, 2, 80)])
def test_fixed_order_attention_decode_equals_prefill(heads, kv_heads, head_dim):
    """One sequence of 75 tokens computed as one prefill, in chunks of 7, and token by token as
    decodes, each beside other sequences: every token's output is the same to the bit in fixed
    order; without it, a decode and a prefill row reduce in different orders."""
    rng = random.Random(heads * head_dim)
    gen = torch.Generator().manual_seed(head_dim)
    block_size, length = 16, 75
    pool_k = torch.zeros(64, block_size, kv_heads, head_dim)
    pool_v = torch.zeros_like(pool_k)
    q = torch.randn(length, heads, head_dim, generator=gen)
    k = torch.randn(length, kv_heads, head_dim, generator=gen)
    v = torch.randn(length, kv_heads, head_dim, generator=gen)
    table = list(range(1, 6))
    others = [(rng.randint(1, 40), rng.randint(41, 120)) for _ in range(5)]
    other_tables = [list(range(6 + 8 * i, 14 + 8 * i)) for i in range(len(others))]

    def with_others(start, end, count, deterministic):
        """Tokens [start, end) of the sequence after `count` other sequences (decodes first)."""
        chosen = others[:count]
        specs, tables, qs, ks, vs = [], [], [], [], []
        mine = ((end - start, end), table, q[start:end], k[start:end], v[start:end])
        rest = []
        for (ql, sl), t in zip(chosen, other_tables):
            rest.append(((ql, sl), t, torch.randn(ql, heads, head_dim, generator=gen),
                         torch.randn(ql, kv_heads, head_dim, generator=gen),
                         torch.randn(ql, kv_heads, head_dim, generator=gen)))
        entries = sorted([mine] + rest, key=lambda e: e[0][0] != 1)  # decodes first, as a step is ordered
        offset = 0
        for spec, t, qq, kk, vv in entries:
            if spec == mine[0] and t is table:
                begin = offset
            specs.append(spec)
            tables.append(t)
            qs.append(qq)
            ks.append(kk)
            vs.append(vv)
            offset += spec[0]
        out = attend(pool_k, pool_v, block_size, specs, tables, qs, ks, vs, deterministic)
        return out[begin:begin + end - start]

    def by_chunks(chunk, deterministic):
        pieces = [with_others(s, min(s + chunk, length), (s // chunk) % (len(others) + 1), deterministic)
                  for s in range(0, length, chunk)]
        return torch.cat(pieces)

    prefill = by_chunks(length, True)
    # and it is attention: causal softmax(q k^T / sqrt(d)) v, each query head on its KV head
    group = heads // kv_heads
    kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(head_dim)
    scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)
    torch.testing.assert_close(prefill, expected, rtol=1e-4, atol=1e-5)
    for chunk in (7, 1):
        assert torch.equal(by_chunks(chunk, True), prefill), f"chunks of {chunk} differ from one prefill"
    # the default order differs somewhere between decodes and a prefill (the mode is doing something)
    lanes = CPU.layer_ops.panel_width // 2  # the kernels' vector width (8 with AVX2, 16 with AVX-512)
    if heads // kv_heads < lanes // 2:  # fewer rows per KV head than half a vector: a decode takes the
        # head_dim-vectorised path, a prefill the row-vectorised one
        assert not torch.equal(by_chunks(1, False), by_chunks(length, False))
