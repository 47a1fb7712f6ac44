"""Sliding-window attention and soft-capped scores (Gemma 2/3) in every backend against the naive
float64 reference: ragged batches of decodes and prefill chunks after cached prefixes, windows shorter
and longer than the contexts, odd lengths, head sizes 64 and 256 (and 40, the compiled kernels'
scalar path), shared-prefix groups whose members' windows leave some or all of the shared keys out
(the compiled kernels' vector and BLAS group passes), the compiled kernels at 1, 2 and 3 threads, and
deterministic mode's bits: a token's row is the same in a decode and in a prefill chunk."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import PagedAttentionMetadata, paged_attention
from kernels.torch_attention import TORCH_BACKEND
from tests.compiled import cpu_backend_or_skip
from tests.kernels.window_cases import Pool, groups_of, ragged, shared, step, with_threads

CPU = cpu_backend_or_skip()


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
