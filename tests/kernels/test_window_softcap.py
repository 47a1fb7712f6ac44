"""Sliding-window attention and soft-capped scores (Gemma 2/3) in every backend against the naive
float64 reference: ragged batches of decodes and prefill chunks after cached prefixes, windows shorter
and longer than the contexts, odd lengths, head sizes 64 and 256 (and 40, the compiled kernels'
scalar path), shared-prefix groups whose members' windows leave some or all of the shared keys out
(the compiled kernels' vector and BLAS group passes), the compiled kernels at 1, 2 and 3 threads, and
deterministic mode's bits: a token's row is the same in a decode and in a prefill chunk."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from kernels import CascadeGroups, PagedAttentionMetadata, paged_attention
from kernels.reference import naive_causal_attention
from kernels.torch_attention import TORCH_BACKEND
from tests.compiled import cpu_backend_or_skip
from workers.cascade import plan_cascade

CPU = cpu_backend_or_skip()


class Pool:
    """A pool whose null block holds NaN: any read of padding would poison the output."""

    def __init__(self, num_blocks, block_size, kv_heads, head_dim, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        self.k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
        self.v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
        self.k[0] = float("nan")
        self.v[0] = float("nan")
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)

    def blocks(self, num_tokens):
        return [self.free.pop() for _ in range(-(-num_tokens // self.block_size))]

    def context(self, table, seq_len):
        idx = torch.tensor(table[: -(-seq_len // self.block_size)])
        shape = (-1,) + tuple(self.k.shape[2:])
        return self.k[idx].reshape(shape)[:seq_len], self.v[idx].reshape(shape)[:seq_len]


def step(backend, pool, specs, tables, num_heads, window, softcap, cascade=None, deterministic=False, seed=1,
         scale=None):
    """Attend a step of ``specs`` ((query_len, seq_len) per sequence, their query K/V already in the
    pool) -> (output, float64 reference)."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads, head_dim = pool.k.shape[2], pool.k.shape[3]
    meta = PagedAttentionMetadata.build([q for q, _ in specs], [s for _, s in specs], tables, pool.block_size,
                                        backend=backend, deterministic=deterministic)
    meta.cascade = cascade
    num_tokens = sum(q for q, _ in specs)
    qkv = torch.randn(num_tokens, num_heads + 2 * kv_heads, head_dim, generator=gen) * 2  # scores past the cap
    query = qkv[:, :num_heads]  # strided, as the model's qkv split makes it
    key = torch.cat([pool.context(t, s)[0][s - q:] for (q, s), t in zip(specs, tables)])
    value = torch.cat([pool.context(t, s)[1][s - q:] for (q, s), t in zip(specs, tables)])
    scale = scale or 1 / math.sqrt(head_dim)
    out = paged_attention(query, key, value, pool.k, pool.v, meta, scale, window=window, softcap=softcap)
    refs, start = [], 0
    for (q, s), table in zip(specs, tables):
        k, v = pool.context(table, s)
        refs.append(naive_causal_attention(query[start:start + q].double(), k.double(), v.double(), scale,
                                           window=window, softcap=softcap))
        start += q
    return out, torch.cat(refs)


def ragged(pool, rng, num_seqs, max_len):
    """Decodes first, then prefill chunks after random prefixes, lengths on and off block edges."""
    bs, specs, tables = pool.block_size, [], []
    num_decodes = rng.randint(1, num_seqs - 1)
    for i in range(num_seqs):
        seq_len = rng.choice([rng.randint(1, max_len), bs * rng.randint(1, 4) + 1, max(1, bs * rng.randint(1, 4) - 1)])
        query_len = 1 if i < num_decodes else min(seq_len, rng.randint(2, max(2, seq_len)))
        specs.append((query_len, seq_len))
        tables.append(pool.blocks(seq_len))
    return specs, tables


def groups_of(specs, tables, block_size, **kw):
    width = max(len(t) for t in tables)
    table = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)
    plan = plan_cascade(table, np.array([s - q for q, s in specs]), block_size, **kw)
    if plan is None:
        return None
    to = torch.from_numpy
    return CascadeGroups(to(plan.kv_starts), to(plan.block_tables), to(plan.lens), to(plan.member_start),
                         to(plan.members))


def shared(pool, groups, extra=()):
    """(shared tokens, members' (query_len, seq_len)) per group, then unshared sequences."""
    specs, tables = [], []
    for length, members in groups:
        prefix = pool.blocks(length)
        for q, s in members:
            specs.append((q, s))
            tables.append(prefix + pool.blocks(s - len(prefix) * pool.block_size))
    for q, s in extra:
        specs.append((q, s))
        tables.append(pool.blocks(s))
    return specs, tables


def with_threads(n, fn):
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(previous)


CASES = [(0, 5.0), (7, 0.0), (13, 2.5)]  # (window, softcap)


@pytest.mark.parametrize("backend", [TORCH_BACKEND, CPU], ids=["torch", "cpu"])
@pytest.mark.parametrize("head_dim,num_heads,kv_heads,block_size", [(64, 8, 2, 5), (256, 4, 2, 16), (40, 6, 3, 3)])
@pytest.mark.parametrize("window,softcap", CASES)
def test_ragged_batches_match_reference(backend, head_dim, num_heads, kv_heads, block_size, window, softcap):
    rng = random.Random(hash((head_dim, block_size, window)) % 997)
    pool = Pool(300, block_size, kv_heads, head_dim, seed=rng.randint(0, 99))
    specs, tables = ragged(pool, rng, num_seqs=7, max_len=60)
    out, ref = step(backend, pool, specs, tables, num_heads, window, softcap, scale=0.11)
    assert torch.isfinite(out).all()
    worst = (out.double() - ref).abs().max().item()
    assert worst < 2e-5, (specs, worst)
    _, plain = step(TORCH_BACKEND, pool, specs, tables, num_heads, 0, 0.0, scale=0.11)
    assert (plain - ref).abs().max().item() > 1e-2  # the test can tell: plain causal attention is far from it


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("head_dim,kv_heads", [(64, 2), (256, 1)])
def test_shared_prefix_groups_with_windows(threads, head_dim, kv_heads):
    """Members whose windows reach into the shared keys, members whose windows lie wholly in their own
    suffix (the group pass sees nothing for them), and a large group (BLAS-sized) whose rows all see
    every shared key beside one whose rows do not: the same as without groups, and the reference."""
    pool = Pool(900, 8, kv_heads, head_dim, seed=5)
    rng = random.Random(threads)
    big = [(1, 200 + rng.randint(1, 30)) for _ in range(36)] + [(9, 260)]
    small = [(1, 70), (1, 65), (1, 111), (9, 80), (3, 131)]
    specs, tables = shared(pool, [(192, big), (64, small)], extra=[(1, 33), (12, 12)])
    cascade = groups_of(specs, tables, 8)
    assert cascade is not None and sorted(cascade.lens.tolist()) == [64, 192]
    for window, softcap in [(300, 0.0), (50, 0.0), (30, 4.0), (0, 4.0)]:
        grouped, ref = with_threads(threads, lambda: step(CPU, pool, specs, tables, 8, window, softcap, cascade))
        plain, _ = with_threads(threads, lambda: step(CPU, pool, specs, tables, 8, window, softcap))
        assert torch.isfinite(grouped).all()
        assert (grouped.double() - ref).abs().max().item() < 2e-5, (window, softcap)
        torch.testing.assert_close(grouped, plain, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_compiled_kernels_at_each_thread_count(threads, head_dim):
    rng = random.Random(head_dim + threads)
    pool = Pool(400, 16, 2, head_dim, seed=threads)
    specs, tables = ragged(pool, rng, num_seqs=9, max_len=300)
    for window, softcap in [(17, 0.0), (64, 30.0)]:
        out, ref = with_threads(threads, lambda: step(CPU, pool, specs, tables, 8, window, softcap))
        assert (out.double() - ref).abs().max().item() < 2e-5


@pytest.mark.parametrize("head_dim", [64, 256])
def test_fixed_order_rows_do_not_depend_on_the_batch(head_dim):
    """Deterministic mode: the last token of a 75-token sequence has the same bits when it is a decode
    as when it is the last row of a 75-token prefill chunk, beside other sequences, at window 20 (the
    item's first tile then depends on its rows) with soft-capping."""
    pool = Pool(100, 8, 2, head_dim, seed=2)
    table = pool.blocks(75)
    other = pool.blocks(40)
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(76, 12, head_dim, generator=gen)

    def last_row(specs, tables, rows):
        meta = PagedAttentionMetadata.build([q for q, _ in specs], [s for _, s in specs], tables, 8, backend=CPU,
                                            deterministic=True)
        k = torch.cat([pool.context(t, s)[0][s - q:] for (q, s), t in zip(specs, tables)])
        v = torch.cat([pool.context(t, s)[1][s - q:] for (q, s), t in zip(specs, tables)])
        out = paged_attention(qkv[rows, :8], k, v, pool.k, pool.v, meta, 0.1, window=20, softcap=6.0)
        return out[-1]

    decode = last_row([(1, 40), (1, 75)], [other, table], [75, 74])
    chunk = last_row([(1, 40), (75, 75)], [other, table], [75] + list(range(75)))
    assert torch.equal(decode, chunk)


def test_bad_window_and_cap_are_refused():
    pool = Pool(10, 4, 1, 64)
    specs, tables = [(3, 3)], [pool.blocks(3)]
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        step(CPU, pool, specs, tables, 2, -1, 0.0)
    with pytest.raises(RuntimeError, match="softcap must be finite"):
        step(CPU, pool, specs, tables, 2, 0, -1.0)
