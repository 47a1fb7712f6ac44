"""Steps of paged attention with a sliding window and soft-capped scores, and their float64
reference (``tests/kernels/test_window_softcap.py``, ``tests/kernels/triton/test_triton_window_softcap.py``)."""

from __future__ import annotations

import math

import torch

from kernels import PagedAttentionMetadata, paged_attention
from kernels.reference import naive_causal_attention
from tests.compiled import threads
from tests.kernels.test_cpu_attention import Pool, shared_batch  # noqa: F401 - Pool: the window tests' pool
from tests.kernels.test_cpu_attention import plan_for as groups_of  # noqa: F401 - the window tests' name


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


def shared(pool, groups, extra=()):
    """(shared tokens, members' (query_len, seq_len)) per group, then unshared sequences."""
    return shared_batch(pool, groups, extra)


def with_threads(n, fn):
    """fn() on ``n`` torch threads."""
    with threads(n):
        return fn()
