"""Steps of paged attention with a sliding window and soft-capped scores, and their float64
reference (``tests/kernels/test_window_softcap.py``, ``tests/kernels/triton/test_triton_window_softcap.py``)."""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from kernels import CascadeGroups, PagedAttentionMetadata, paged_attention
from kernels.reference import naive_causal_attention
from workers.cascade import plan_cascade


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
