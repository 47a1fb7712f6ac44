"""The Triton attention kernel (under the interpreter) with a sliding window and soft-capped scores
against the float64 reference: ragged batches of decodes and prefill chunks after cached prefixes,
head sizes 64 and 256, split keys, and deterministic mode's bits (a token's row is the same in a
decode and in a prefill chunk). Window and cap are runtime arguments: they add no compiled variant."""

from __future__ import annotations

import pytest
import torch

from kernels import PagedAttentionMetadata, paged_attention
from kernels.triton import TritonAttentionBackend
from kernels.triton.warmup import record_launches
from tests.kernels.window_cases import Pool, step


@pytest.mark.parametrize("head_dim,num_heads,kv_heads,block_size,window,softcap", [
    (64, 8, 2, 5, 7, 0.0), (64, 8, 2, 5, 0, 5.0), (256, 4, 2, 16, 13, 2.5)])
def test_ragged_batches_match_reference(head_dim, num_heads, kv_heads, block_size, window, softcap):
    pool = Pool(200, block_size, kv_heads, head_dim, seed=window)
    specs = [(1, 61), (1, 47), (1, 5), (9, 58), (20, 20), (3, 33)]  # decodes, then chunks after prefixes
    tables = [pool.blocks(s) for _, s in specs]
    backend = TritonAttentionBackend(block_n=16, target_programs=256, min_split_tiles=1)  # splits the keys too
    out, ref = step(backend, pool, specs, tables, num_heads, window, softcap, scale=0.11)
    assert any(launch.num_splits > 1 for launch in backend.last_plan)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max().item() < 2e-5


def test_window_and_cap_add_no_variant():
    pool = Pool(40, 8, 2, 64)
    specs, tables = [(1, 30), (9, 20)], [pool.blocks(30), pool.blocks(20)]
    keys = []
    for window, softcap in [(0, 0.0), (7, 30.0), (4096, 50.0)]:
        with record_launches() as launches:
            step(TritonAttentionBackend(), pool, specs, tables, 8, window, softcap)
        keys.append({launch.key for launch in launches})
    assert keys[0] == keys[1] == keys[2]


def test_deterministic_rows_do_not_depend_on_the_batch():
    pool = Pool(100, 8, 2, 64, seed=2)
    table, other = pool.blocks(75), pool.blocks(40)
    qkv = torch.randn(76, 12, 64, generator=torch.Generator().manual_seed(0))
    backend = TritonAttentionBackend()

    def last_row(specs, tables, rows):
        meta = PagedAttentionMetadata.build([q for q, _ in specs], [s for _, s in specs], tables, 8,
                                            backend=backend, deterministic=True)
        k = torch.cat([pool.context(t, s)[0][s - q:] for (q, s), t in zip(specs, tables)])
        v = torch.cat([pool.context(t, s)[1][s - q:] for (q, s), t in zip(specs, tables)])
        return paged_attention(qkv[rows, :8], k, v, pool.k, pool.v, meta, 0.1, window=20, softcap=6.0)[-1]

    assert torch.equal(last_row([(1, 40), (1, 75)], [other, table], [75, 74]),
                       last_row([(1, 40), (75, 75)], [other, table], [75] + list(range(75))))
