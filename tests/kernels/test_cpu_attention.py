"""The compiled CPU kernels against the naive reference: ragged batches, block boundaries, grouped-query
ratios 1-8, head sizes on and off the vector path, null-block padding, and shared-prefix groups."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from kernels import CascadeGroups, PagedAttentionMetadata, paged_attention
from kernels.reference import naive_causal_attention
from tests.compiled import cpu_backend_or_skip, threads
from workers.cascade import plan_cascade

CPU = cpu_backend_or_skip()


class Pool:
    """A pool whose null block holds NaN: any read of padding would poison the output."""

    def __init__(self, num_blocks, block_size, kv_heads, head_dim, dtype=torch.float32, seed=0):
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        self.block_size = block_size
        self.k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=self.gen).to(dtype)
        self.v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=self.gen).to(dtype)
        self.k[0] = float("nan")
        self.v[0] = float("nan")
        self.free = list(range(1, num_blocks))
        self.rng.shuffle(self.free)

    def blocks(self, num_tokens):
        return [self.free.pop() for _ in range(-(-num_tokens // self.block_size))]

    def context(self, table, seq_len):
        idx = torch.tensor(table[: -(-seq_len // self.block_size)])
        shape = (-1,) + tuple(self.k.shape[2:])
        return self.k[idx].reshape(shape)[:seq_len], self.v[idx].reshape(shape)[:seq_len]


def attend(pool, specs, tables, num_heads, cascade=None, dtype=torch.float32, seed=1):
    """specs: (query_len, seq_len) per sequence; K/V of the query tokens are already in the pool.
    Returns the compiled kernels' output and the float64 reference of every query row."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads, head_dim = pool.k.shape[2], pool.k.shape[3]
    meta = PagedAttentionMetadata.build([q for q, _ in specs], [s for _, s in specs], tables, pool.block_size,
                                        backend=CPU)
    meta.cascade = cascade
    num_tokens = sum(q for q, _ in specs)
    # a strided query, as the model's qkv split makes it
    qkv = torch.randn(num_tokens, num_heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    query = qkv[:, :num_heads]
    key = torch.cat([pool.context(t, s)[0][s - q:] for (q, s), t in zip(specs, tables)])
    value = torch.cat([pool.context(t, s)[1][s - q:] for (q, s), t in zip(specs, tables)])
    scale = 1 / math.sqrt(head_dim)
    out = paged_attention(query, key, value, pool.k, pool.v, meta, scale)
    refs, start = [], 0
    for (q, s), table in zip(specs, tables):
        k, v = pool.context(table, s)
        refs.append(naive_causal_attention(query[start:start + q].double(), k.double(), v.double(), scale))
        start += q
    return out, torch.cat(refs)


def run(pool, specs, tables, num_heads, cascade=None, dtype=torch.float32, seed=1):
    """``attend``'s largest error against the reference, and the output."""
    out, ref = attend(pool, specs, tables, num_heads, cascade, dtype, seed)
    return (out.double() - ref).abs().max().item(), out


def random_batch(pool, rng, num_seqs, max_len):
    """Decodes first, then prefill chunks after random prefixes; lengths on, before and after block edges."""
    bs = pool.block_size
    specs, tables = [], []
    num_decodes = rng.randint(0, num_seqs)
    for i in range(num_seqs):
        seq_len = rng.choice([rng.randint(1, max_len), bs * rng.randint(1, 4), bs * rng.randint(1, 4) + 1,
                              max(1, bs * rng.randint(1, 4) - 1)])
        query_len = 1 if i < num_decodes else rng.randint(2, max(2, seq_len)) if seq_len > 1 else 1
        query_len = min(query_len, seq_len)
        specs.append((query_len, seq_len))
        tables.append(pool.blocks(seq_len))
    return specs, tables


@pytest.mark.parametrize("num_heads,kv_heads", [(4, 4), (8, 4), (6, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("head_dim", [16, 40, 64, 128])
@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
def test_ragged_batches_match_reference(num_heads, kv_heads, head_dim, block_size):
    rng = random.Random(hash((num_heads, kv_heads, head_dim, block_size)) % 1000)
    pool = Pool(600 if block_size == 1 else 200, block_size, kv_heads, head_dim, seed=rng.randint(0, 99))
    specs, tables = random_batch(pool, rng, num_seqs=6, max_len=90)
    worst, out = run(pool, specs, tables, num_heads)
    assert torch.isfinite(out).all()
    assert worst < 1e-5, (specs, worst)


@pytest.mark.parametrize("num_heads,kv_heads,head_dim", [(8, 4, 64), (12, 4, 48), (4, 2, 128)])
def test_runs_of_a_sequences_kv_heads_at_thread_counts(num_heads, kv_heads, head_dim):
    """Decodes' items go out in runs of a sequence's KV heads (run_pass), capped by the items a thread
    should get: at 1, 2, 3 and 8 threads every output row is the reference's, and the same bits
    whichever thread ran it."""
    rng = random.Random(head_dim)
    pool = Pool(400, 16, kv_heads, head_dim, seed=head_dim)
    specs = [(1, rng.randint(1, 120)) for _ in range(37)] + [(23, 23), (9, 70), (1, 1)]
    tables = [pool.blocks(s) for _, s in specs]
    outs = []
    for n in (1, 2, 3, 8):
        with threads(n):
            worst, out = run(pool, specs, tables, num_heads)
        assert worst < 1e-5, (n, worst)
        outs.append(out)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


@pytest.mark.parametrize("head_dim", [32, 48, 80, 112])
@pytest.mark.parametrize("num_heads,kv_heads", [(7, 1), (6, 2), (4, 4)])
def test_prefill_blocks_and_their_remainders_match_reference(num_heads, kv_heads, head_dim):
    """The row-vectorised (prefill) path computes a tile's scores in blocks of rows x keys and its
    outputs in blocks of rows x vectors of head_dim, then smaller blocks for what is left over: head
    sizes whose vectors leave 1, 2 or 3 after slices of 4, items of every row count from 8 to 64
    (group sizes 7, 3 and 1) and tiles of every number of keys."""
    pool = Pool(80, 16, kv_heads, head_dim, seed=head_dim + num_heads)
    specs = [(2, 2), (3, 8), (5, 6), (9, 36), (13, 15), (16, 56), (23, 26), (37, 48), (64, 64)]
    tables = [pool.blocks(s) for _, s in specs]
    worst, out = run(pool, specs, tables, num_heads)
    assert torch.isfinite(out).all()
    assert worst < 1e-5, worst


def test_null_block_padding_is_never_read():
    pool = Pool(50, 16, 2, 64)
    tables = [pool.blocks(20), pool.blocks(70), pool.blocks(3)]  # ragged: the table pads with block 0
    worst, out = run(pool, [(1, 20), (1, 70), (3, 3)], tables, 8)
    assert torch.isfinite(out).all() and worst < 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_half_types(dtype, tol):
    pool = Pool(100, 16, 2, 64, dtype=dtype)
    specs = [(1, 40), (1, 17), (30, 50)]
    worst, _ = run(pool, specs, [pool.blocks(s) for _, s in specs], 8, dtype=dtype)
    assert worst < tol


def shared_batch(pool, groups, extra):
    """groups: (shared tokens, [(query_len, seq_len)...]) whose members share the first shared tokens'
    blocks; extra: unshared sequences. Returns specs and tables."""
    specs, tables = [], []
    bs = pool.block_size
    for shared, members in groups:
        prefix = pool.blocks(shared)
        for query_len, seq_len in members:
            specs.append((query_len, seq_len))
            tables.append(prefix + pool.blocks(seq_len - len(prefix) * bs))
    for query_len, seq_len in extra:
        specs.append((query_len, seq_len))
        tables.append(pool.blocks(seq_len))
    return specs, tables


def plan_for(specs, tables, block_size, **kw):
    width = max(len(t) for t in tables)
    table = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)
    first = np.array([s - q for q, s in specs])
    plan = plan_cascade(table, first, block_size, **kw)
    if plan is None:
        return None
    to = torch.from_numpy
    return CascadeGroups(to(plan.kv_starts), to(plan.block_tables), to(plan.lens), to(plan.member_start),
                         to(plan.members))


@pytest.mark.parametrize("num_heads,kv_heads,head_dim", [(8, 2, 64), (4, 4, 128), (8, 1, 40)])
def test_shared_prefix_groups_match_reference(num_heads, kv_heads, head_dim):
    pool = Pool(400, 8, kv_heads, head_dim)
    # two groups: decodes after a 64-token prefix (one member also prefilling a chunk after it), and
    # decodes after a 40-token prefix; plus sequences that share nothing
    specs, tables = shared_batch(pool, [(64, [(1, 70), (1, 65), (1, 90), (9, 80)]), (40, [(1, 41), (1, 57)])],
                                 extra=[(1, 33), (12, 12)])
    cascade = plan_for(specs, tables, 8)
    assert cascade is not None and cascade.num_groups == 2
    assert sorted(cascade.lens.tolist()) == [40, 64]
    with_groups, out_groups = run(pool, specs, tables, num_heads, cascade=cascade)
    without, out_plain = run(pool, specs, tables, num_heads)
    assert with_groups < 1e-5 and without < 1e-5
    torch.testing.assert_close(out_groups, out_plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads,kv_heads,head_dim", [(8, 2, 64), (8, 1, 40), (4, 4, 128)])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_large_groups_through_blas_match_reference(num_heads, kv_heads, head_dim, num_threads):
    """Groups with many query rows per KV head take the BLAS path (group_attention.cpp): a 604-token
    prefix is two key chunks (512 + 92: a tail that is no multiple of the vector width), 40 decodes
    and two 30-token prefill chunks make 100 x (heads per KV head) rows, split into tiles of up to 256;
    a small group beside it stays on the vector kernel."""
    pool = Pool(1000, 4, kv_heads, head_dim, seed=3)
    rng = random.Random(7)
    members = [(1, 604 + rng.randint(1, 36)) for _ in range(40)] + [(30, 640), (30, 700)]
    specs, tables = shared_batch(pool, [(604, members), (40, [(1, 41), (2, 57)])], extra=[(5, 9)])
    cascade = plan_for(specs, tables, 4)
    assert cascade is not None and sorted(cascade.lens.tolist()) == [40, 604]
    with threads(num_threads):
        with_groups, out_groups = run(pool, specs, tables, num_heads, cascade=cascade)
    without, out_plain = run(pool, specs, tables, num_heads)
    assert torch.isfinite(out_groups).all()
    assert with_groups < 1e-5 and without < 1e-5, (with_groups, without)
    torch.testing.assert_close(out_groups, out_plain, atol=1e-5, rtol=1e-5)


def test_a_member_prefilling_inside_the_shared_blocks_is_left_out():
    """A request computing the prefix in this step (its queries start at 0) shares the blocks but must
    not join the group: its keys are not all before its queries."""
    pool = Pool(100, 8, 2, 64)
    specs, tables = shared_batch(pool, [(32, [(1, 40), (1, 35), (36, 36)])], extra=[])
    cascade = plan_for(specs, tables, 8)
    assert cascade is not None
    assert cascade.members.tolist() == [0, 1] and cascade.kv_starts.tolist() == [32, 32, 0]
    worst, _ = run(pool, specs, tables, 8, cascade=cascade)
    assert worst < 1e-5
