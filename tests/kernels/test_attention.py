"""Paged attention and the KV store, every backend, against naive contiguous attention."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import PagedAttentionMetadata, paged_attention, select_backend, store_kv
from kernels.reference import naive_causal_attention

BACKENDS = ["torch", "cpu"]


def backend(name: str):
    return select_backend(name, torch.device("cpu"))[0]


def _build_step(seq_specs, num_heads, kv_heads, head_dim, block_size, dtype, seed=0, backend_name="torch"):
    """seq_specs: (prefix_len, query_len) per request, decodes (query_len 1) first.

    Returns the inputs of one step plus each request's full contiguous K/V, with the prefix K/V
    already in the pool at shuffled block ids.
    """
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-(p + q) // block_size) for p, q in seq_specs)
    num_blocks = 1 + max_blocks * len(seq_specs) + 3
    k_pool = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_pool = torch.zeros_like(k_pool)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # never block 0
    tables, full_k, full_v = [], [], []
    qs, ks, vs = [], [], []
    for prefix_len, query_len in seq_specs:
        seq_len = prefix_len + query_len
        blocks = [free.pop() for _ in range(-(-seq_len // block_size))]
        tables.append(blocks)
        k = torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(dtype)
        slot = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(seq_len)])
        store_kv(k[:prefix_len], v[:prefix_len], k_pool, v_pool, slot[:prefix_len])
        full_k.append(k)
        full_v.append(v)
        qs.append(torch.randn(query_len, num_heads, head_dim, generator=gen).to(dtype))
        ks.append(k[prefix_len:])
        vs.append(v[prefix_len:])
    meta = PagedAttentionMetadata.build([q for _, q in seq_specs], [p + q for p, q in seq_specs], tables,
                                        block_size, backend=backend(backend_name))
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), k_pool, v_pool, meta, full_k, full_v


CASES = {
    "decode_only": [(5, 1), (0, 1), (40, 1), (16, 1)],
    "prefill_only": [(0, 7), (0, 33), (0, 1 + 16)],
    "prefix_hits": [(16, 5), (32, 1 + 30), (8, 9)],
    "mixed": [(3, 1), (70, 1), (0, 12), (48, 20), (5, 2)],
}


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("num_heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_paged_attention_matches_naive(backend_name, case, num_heads, kv_heads, block_size):
    head_dim = 16
    q, k, v, k_pool, v_pool, meta, full_k, full_v = _build_step(
        CASES[case], num_heads, kv_heads, head_dim, block_size, torch.float32, backend_name=backend_name
    )
    scale = 1 / math.sqrt(head_dim)
    out = paged_attention(q, k, v, k_pool, v_pool, meta, scale)
    start = 0
    for (prefix_len, query_len), fk, fv in zip(CASES[case], full_k, full_v):
        ref = naive_causal_attention(q[start : start + query_len], fk, fv, scale)
        torch.testing.assert_close(out[start : start + query_len], ref, atol=1e-5, rtol=1e-5)
        start += query_len


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_types_close_to_float32(backend_name, dtype):
    specs = CASES["mixed"]
    q, k, v, kp, vp, meta, fk, fv = _build_step(specs, 8, 2, 32, 16, dtype, backend_name=backend_name)
    out = paged_attention(q, k, v, kp, vp, meta, 1 / math.sqrt(32))
    start = 0
    for (p, ql), kk, vv in zip(specs, fk, fv):
        ref = naive_causal_attention(q[start : start + ql].float(), kk.float(), vv.float(), 1 / math.sqrt(32))
        torch.testing.assert_close(out[start : start + ql].float(), ref, atol=3e-2, rtol=3e-2)
        start += ql


def test_store_kv_writes_only_its_slots():
    k_pool = torch.zeros(4, 8, 2, 4)
    v_pool = torch.zeros(4, 8, 2, 4)
    key = torch.arange(3 * 2 * 4, dtype=torch.float32).view(3, 2, 4) + 1
    slots = torch.tensor([8 * 2 + 3, 8 * 3 + 0, 8 * 1 + 7])
    store_kv(key, -key, k_pool, v_pool, slots)
    assert torch.equal(k_pool[2, 3], key[0]) and torch.equal(k_pool[3, 0], key[1])
    assert torch.equal(k_pool[1, 7], key[2]) and torch.equal(v_pool[1, 7], -key[2])
    assert int((k_pool != 0).any(-1).any(-1).sum()) == 3  # three slots written, nothing else


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_same_step_prefix_share_reads_fresh_kv(backend_name):
    """Two requests with one 16-token prefix in one step: the second reads the blocks the first
    writes in the same call (the store precedes the reads)."""
    gen = torch.Generator().manual_seed(1)
    bs, heads, d = 16, 2, 8
    k_pool = torch.zeros(4, bs, heads, d)
    v_pool = torch.zeros_like(k_pool)
    prefix_k, prefix_v = torch.randn(16, heads, d, generator=gen), torch.randn(16, heads, d, generator=gen)
    tail_k, tail_v = torch.randn(4, heads, d, generator=gen), torch.randn(4, heads, d, generator=gen)
    q = torch.randn(16 + 4, heads, d, generator=gen)
    # request A computes the prefix into block 1; request B shares block 1 and computes 4 tokens in block 2
    meta = PagedAttentionMetadata.build([16, 4], [16, 20], [[1], [1, 2]], bs, backend=backend(backend_name))
    out = paged_attention(q, torch.cat([prefix_k, tail_k]), torch.cat([prefix_v, tail_v]), k_pool, v_pool, meta, d**-0.5)
    ref_b = naive_causal_attention(q[16:], torch.cat([prefix_k, tail_k]), torch.cat([prefix_v, tail_v]), d**-0.5)
    torch.testing.assert_close(out[16:], ref_b, atol=1e-5, rtol=1e-5)


def test_decode_slices_keep_each_gather_within_the_budget():
    from kernels.torch_attention import decode_slices

    # 10 bytes per token, budget 100: [4, 4] (2 x 4 x 10 = 80), then 8 alone would need 3 x 8 x 10
    assert decode_slices([4, 4, 8, 2, 1], 10, 100) == [(0, 2, 4), (2, 3, 8), (3, 5, 2)]
    assert decode_slices([50, 3], 10, 100) == [(0, 1, 50), (1, 2, 3)]  # over budget alone: its own slice
    assert decode_slices([1] * 6, 10, 1000) == [(0, 6, 1)]
    assert decode_slices([], 10, 100) == []


def test_the_torch_decode_gather_stays_within_its_budget(monkeypatch):
    """With a budget of two of the longest contexts, the decodes run in two slices (each gathering up
    to its own longest context): the same outputs as one batch, no gathered K or V over half the budget."""
    import kernels.torch_attention as ta

    specs = [(5, 1), (0, 1), (40, 1), (16, 1), (100, 1), (7, 1), (0, 9)]  # contexts 8, 8, 48, 24, 104, 8 in slots
    q, k, v, k_pool, v_pool, meta, full_k, full_v = _build_step(specs, 4, 2, 16, 8, torch.float32)
    scale = 1 / math.sqrt(16)
    gathered = []
    real_gather = ta._gather

    def recording_gather(pool, block_ids, *rest):
        out = real_gather(pool, block_ids, *rest)
        gathered.append(out.numel() * out.element_size())
        return out

    monkeypatch.setattr(ta, "_gather", recording_gather)
    whole = paged_attention(q, k, v, k_pool, v_pool, meta, scale)
    per_token = 2 * 16 * 4  # one of K or V: 2 KV heads of 16 floats
    assert gathered == [6 * 104 * per_token] * 2  # the default budget: one slice, K and V
    gathered.clear()
    monkeypatch.setattr(ta, "DECODE_GATHER_BYTES", 2 * 104 * 2 * per_token)
    sliced = paged_attention(q, k, v, k_pool, v_pool, meta, scale)
    torch.testing.assert_close(sliced, whole, atol=0, rtol=0)
    assert gathered == [4 * 48 * per_token] * 2 + [2 * 104 * per_token] * 2
