"""A hybrid KV layout's window tables keep stale entries below a request's window (a released page
another request may now fill with anything): no backend may let them affect a window layer's result.

Each step is attended twice through the same backend: with the true tables (every block's real page)
and with window tables whose entries below each sequence's window (``KVLayout.first_needed_block`` of
its computed tokens) name pages full of NaN (or the null block, NaN here too). The two outputs must be
the same bits, finite, and match the float64 reference. Paths: decodes, prefill chunks after a
prefix, shared-prefix groups (compiled CPU: the groups' blocks taken from the member whose window
reaches furthest back, ``workers.cascade.window_group_tables``), deterministic mode, soft-capping."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from engine.kv_layout import KVLayout
from kernels import CascadeGroups, PagedAttentionMetadata, paged_attention
from kernels.reference import naive_causal_attention
from kernels.torch_attention import TORCH_BACKEND
from kernels.triton import TritonAttentionBackend
from tests.compiled import cpu_backend_or_skip
from tests.kernels.window_cases import Pool, shared
from workers.cascade import plan_cascade, window_group_tables

CPU = cpu_backend_or_skip()
NUM_HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32


def first_needed(window, block_size, computed):
    layout = KVLayout(2, window, (0,))  # one window layer, one full layer: only the window rule matters
    return layout.first_needed_block(computed, block_size)


def stale_tables(pool, specs, tables, window, rng, num_nan_pages=6):
    """The tables with each entry below the sequence's window replaced by a NaN page or the null block."""
    nan_pages = pool.blocks(num_nan_pages * pool.block_size)
    pool.k[nan_pages] = float("nan")
    pool.v[nan_pages] = float("nan")
    out, replaced = [], 0
    for (q, s), table in zip(specs, tables):
        below = first_needed(window, pool.block_size, s - q)
        out.append([rng.choice(nan_pages + [0]) for _ in range(below)] + table[below:])
        replaced += below
    assert replaced > 0
    return out


def padded(tables):
    width = max(len(t) for t in tables)
    return np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)


def groups(specs, tables, window_tables, block_size):
    """Shared-prefix groups planned from the block tables, their blocks from ``window_tables``."""
    first = np.array([s - q for q, s in specs])
    plan = plan_cascade(padded(tables), first, block_size)
    assert plan is not None
    block_tables = window_group_tables(plan, padded(window_tables), first, block_size)
    to = torch.from_numpy
    return CascadeGroups(to(plan.kv_starts), to(block_tables), to(plan.lens), to(plan.member_start),
                         to(plan.members))


def attend(backend, pool, specs, tables, window, softcap, *, cascade=False, true_tables=None,
           deterministic=False, seed=1):
    """The step through ``tables`` (its query K/V stored again from the true context) -> (output, reference)."""
    true_tables = true_tables or tables
    gen = torch.Generator().manual_seed(seed)
    meta = PagedAttentionMetadata.build([q for q, _ in specs], [s for _, s in specs], tables, pool.block_size,
                                        backend=backend, deterministic=deterministic)
    if cascade:
        meta.cascade = groups(specs, true_tables, tables, pool.block_size)
    query = torch.randn(sum(q for q, _ in specs), NUM_HEADS, HEAD_DIM, generator=gen) * 2
    key = torch.cat([pool.context(t, s)[0][s - q:] for (q, s), t in zip(specs, true_tables)])
    value = torch.cat([pool.context(t, s)[1][s - q:] for (q, s), t in zip(specs, true_tables)])
    scale = 1 / math.sqrt(HEAD_DIM)
    out = paged_attention(query, key, value, pool.k, pool.v, meta, scale, window=window, softcap=softcap)
    refs, start = [], 0
    for (q, s), table in zip(specs, true_tables):
        k, v = pool.context(table, s)
        refs.append(naive_causal_attention(query[start:start + q].double(), k.double(), v.double(), scale,
                                           window=window, softcap=softcap))
        start += q
    return out, torch.cat(refs)


def check(backend, pool, specs, tables, window, softcap, seed=0, **kw):
    stale = stale_tables(pool, specs, tables, window, random.Random(seed))
    out_true, ref = attend(backend, pool, specs, tables, window, softcap, **kw)
    out_stale, _ = attend(backend, pool, specs, stale, window, softcap, true_tables=tables, **kw)
    assert torch.isfinite(out_stale).all()
    assert torch.equal(out_stale, out_true)
    assert (out_stale.double() - ref).abs().max().item() < 2e-5


def decodes_and_chunks(pool, window):
    """Decodes and prefill chunks after prefixes, each context several windows long, on and off block edges."""
    specs = [(1, 3 * window + 1), (1, 2 * window + pool.block_size), (1, 5 * window - 3), (1, window + 2),
             (7, 4 * window), (2 * window, 3 * window + 5), (3, window + pool.block_size + 1)]
    return specs, [pool.blocks(s) for _, s in specs]


BACKENDS = {"cpu": lambda: CPU, "torch": lambda: TORCH_BACKEND,
            "triton": lambda: TritonAttentionBackend(block_n=16, target_programs=64, min_split_tiles=1)}


CASES = [(4, 20, 0.0), (8, 40, 0.0), (16, 24, 5.0)]


@pytest.mark.parametrize("name,block_size,window,softcap", [(n, *c) for n in ("cpu", "torch") for c in CASES]
                         + [("triton", 4, 20, 0.0), ("triton", 16, 24, 5.0)])  # (the interpreter is slow)
def test_decodes_and_chunks_ignore_stale_pages(name, block_size, window, softcap):
    pool = Pool(600, block_size, KV_HEADS, HEAD_DIM, seed=window)
    specs, tables = decodes_and_chunks(pool, window)
    check(BACKENDS[name](), pool, specs, tables, window, softcap)


@pytest.mark.parametrize("name", ["cpu", "triton"])
def test_deterministic_mode_ignores_stale_pages(name):
    pool = Pool(400, 4, KV_HEADS, HEAD_DIM, seed=3)
    specs, tables = decodes_and_chunks(pool, 20)
    check(BACKENDS[name](), pool, specs, tables, 20, 0.0, deterministic=True)


@pytest.mark.parametrize("block_size,window,softcap", [(4, 20, 0.0), (8, 40, 0.0), (4, 28, 3.0)])
def test_shared_prefix_groups_ignore_stale_pages(block_size, window, softcap):
    """Members whose windows reach into the shared prefix, others whose windows lie past it; each
    member's own window table has stale entries below its window, the group's come from the member
    whose window reaches furthest back (not the first member, whose window lies past the prefix)."""
    pool = Pool(800, block_size, KV_HEADS, HEAD_DIM, seed=block_size)
    p = 16 * block_size  # shared tokens
    specs, tables = shared(pool, [(p, [(1, p + window + 9), (9, p + 16), (1, p + 2), (1, p + 5)]),
                                  (p, [(1, p + 3), (2 * window, p + 2 * window + 4)])],
                           extra=[(1, p + 7), (5, 3 * window)])
    stale = stale_tables(pool, specs, tables, window, random.Random(block_size))
    cascade = groups(specs, tables, stale, block_size)
    assert cascade.num_groups == 2
    # the group's blocks below its source member's window are stale, and some members' own rows are
    # stale where the group's row is not (their windows start later)
    assert any(b == 0 or torch.isnan(pool.k[b]).all() for b in cascade.block_tables.flatten().tolist())
    out_true, ref = attend(CPU, pool, specs, tables, window, softcap, cascade=True)
    out_stale, _ = attend(CPU, pool, specs, stale, window, softcap, cascade=True, true_tables=tables)
    assert torch.isfinite(out_stale).all()
    assert (out_stale.double() - ref).abs().max().item() < 2e-5
    assert (out_true.double() - ref).abs().max().item() < 2e-5
    assert torch.equal(out_stale, out_true)
