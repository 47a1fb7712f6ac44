"""The compiled CPU kernels refuse metadata that would make them read or write outside the pool,
with the reason, before any thread runs: block ids outside the pool, slots outside it (-1 included),
tables with too few rows, and shared-prefix groups whose membership does not hold. The pool is left
as it was. Head sizes past the vector kernel's registers take the scalar kernel."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch

from kernels import CascadeGroups, PagedAttentionMetadata
from tests.compiled import cpu_backend_or_skip

CPU = cpu_backend_or_skip()
BLOCK, KV_HEADS, HEADS, D, BLOCKS = 4, 2, 4, 16, 12


def _step(tables, specs, cascade=None):
    meta = PagedAttentionMetadata.build([q for q, _ in specs], [s for _, s in specs], tables, BLOCK, backend=CPU)
    meta.cascade = cascade
    tokens = sum(q for q, _ in specs)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, HEADS, D, generator=gen)
    k = torch.randn(tokens, KV_HEADS, D, generator=gen)
    v = torch.randn(tokens, KV_HEADS, D, generator=gen)
    return meta, q, k, v


def _pools():
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(BLOCKS, BLOCK, KV_HEADS, D, generator=gen), torch.randn(BLOCKS, BLOCK, KV_HEADS, D, generator=gen))


def _attend(meta, q, k, v, k_pool, v_pool):
    return CPU.forward(q, k, v, k_pool, v_pool, meta, 1 / math.sqrt(D))


def _refused(match, meta, q, k, v):
    k_pool, v_pool = _pools()
    before = k_pool.clone(), v_pool.clone()
    with pytest.raises(RuntimeError, match=match):
        _attend(meta, q, k, v, k_pool, v_pool)
    assert torch.equal(k_pool, before[0]) and torch.equal(v_pool, before[1]), "a refused step wrote the pool"


def test_a_good_step_runs():
    meta, q, k, v = _step([[1, 2], [3]], [(1, 6), (3, 3)])
    out = _attend(meta, q, k, v, *_pools())
    assert out.shape == q.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("bad", [BLOCKS, BLOCKS + 1000, -1, -(2**31)])
def test_a_block_id_outside_the_pool_is_refused(bad):
    meta, q, k, v = _step([[1, 2], [3]], [(1, 6), (3, 3)])
    meta.block_tables[0, 0] = bad  # a context block, read (not written) by the step
    _refused(f"block {bad} .* outside the pool of {BLOCKS} blocks", meta, q, k, v)


def test_table_entries_past_the_context_are_not_read_and_not_checked():
    meta, q, k, v = _step([[1, 2, 0], [3, 0, 0]], [(1, 6), (3, 3)])
    meta.block_tables[1, 2] = 10**6  # past sequence 1's 3 tokens: padding the kernels never read
    assert torch.isfinite(_attend(meta, q, k, v, *_pools())).all()


@pytest.mark.parametrize("bad", [-1, BLOCKS * BLOCK, 10**9])
def test_a_slot_outside_the_pool_is_refused(bad):
    meta, q, k, v = _step([[1, 2], [3]], [(1, 6), (3, 3)])
    meta.slot_mapping[2] = bad
    _refused(rf"slot_mapping\[2\] = {bad} is outside the pool's {BLOCKS * BLOCK} slots", meta, q, k, v)


def test_a_table_with_too_few_rows_is_refused():
    meta, q, k, v = _step([[1, 2], [3]], [(1, 6), (3, 3)])
    meta.block_tables = meta.block_tables[:1].contiguous()
    _refused("block_tables needs a row for each of the 2 sequences", meta, q, k, v)


def _grouped():
    """Sequences 0 and 1 share block 1 (4 tokens); sequence 2 shares nothing."""
    meta, q, k, v = _step([[1, 2], [1, 3], [4]], [(1, 6), (1, 7), (2, 2)])
    groups = CascadeGroups(kv_starts=torch.tensor([4, 4, 0], dtype=torch.int32),
                           block_tables=torch.tensor([[1]], dtype=torch.int32),
                           lens=torch.tensor([4], dtype=torch.int32),
                           member_start=torch.tensor([0, 2], dtype=torch.int32),
                           members=torch.tensor([0, 1], dtype=torch.int32))
    meta.cascade = groups
    return meta, q, k, v


def test_good_groups_run_and_equal_the_plain_pass():
    meta, q, k, v = _grouped()
    k_pool, v_pool = _pools()
    grouped = _attend(meta, q, k, v, k_pool, v_pool)
    meta.cascade = None
    torch.testing.assert_close(grouped, _attend(meta, q, k, v, k_pool, v_pool), atol=1e-6, rtol=1e-5)


def test_a_shared_part_without_a_group_is_refused():
    meta, q, k, v = _grouped()
    meta.cascade.member_start = torch.tensor([0, 1], dtype=torch.int32)  # sequence 1 left out of the group
    meta.cascade.members = torch.tensor([0], dtype=torch.int32)
    _refused("sequence 1 has a shared part of 4 tokens but no group", meta, q, k, v)


def test_a_sequence_in_two_groups_is_refused():
    meta, q, k, v = _grouped()
    c = meta.cascade
    c.block_tables = torch.tensor([[1], [1]], dtype=torch.int32)
    c.lens = torch.tensor([4, 4], dtype=torch.int32)
    c.member_start = torch.tensor([0, 2, 3], dtype=torch.int32)
    c.members = torch.tensor([0, 1, 1], dtype=torch.int32)
    _refused("sequence 1 is a member of groups 0 and 1", meta, q, k, v)


def test_member_ranges_are_checked_before_any_member_is_read():
    """A middle entry of member_start far past the members: refused before group 0's range (which it
    would end) is walked."""
    meta, q, k, v = _grouped()
    c = meta.cascade
    c.block_tables = torch.tensor([[1], [1]], dtype=torch.int32)
    c.lens = torch.tensor([4, 4], dtype=torch.int32)
    c.member_start = torch.tensor([0, 1 << 30, 2], dtype=torch.int32)
    _refused("group_member_start must not decrease", meta, q, k, v)


def test_a_group_block_outside_the_pool_is_refused():
    meta, q, k, v = _grouped()
    meta.cascade.block_tables = torch.tensor([[BLOCKS]], dtype=torch.int32)
    _refused(f"group 0: block {BLOCKS} .* outside the pool", meta, q, k, v)


def test_a_group_table_with_too_few_rows_is_refused():
    meta, q, k, v = _grouped()
    meta.cascade.block_tables = torch.zeros(0, 1, dtype=torch.int32)
    _refused("group_block_tables needs a row for each of the 1 groups", meta, q, k, v)


def test_kv_starts_of_another_length_are_refused():
    meta, q, k, v = _grouped()
    meta.cascade.kv_starts = torch.tensor([4, 4], dtype=torch.int32)
    _refused("kv_starts needs one entry per sequence", meta, q, k, v)


def test_a_shared_part_with_no_groups_at_all_is_refused():
    meta, q, k, v = _step([[1, 2], [1, 3]], [(1, 6), (1, 7)])
    kernel = CPU.ops.paged_attention.default
    empty = torch.zeros(0, dtype=torch.int32)
    k_pool, v_pool = _pools()
    with pytest.raises(RuntimeError, match="sequence 0 has a shared part of 4 tokens but no group"):
        kernel(q, k, v, k_pool, v_pool, meta.slot_mapping, meta.block_tables, meta.query_start_loc, meta.seq_lens,
               torch.tensor([4, 0], dtype=torch.int32), torch.zeros(0, 0, dtype=torch.int32), empty, empty, empty,
               0.25, False)


# Head sizes whose accumulators exceed the vector kernel's 64 vectors (576 with AVX2's 8 lanes, 1152 with
# AVX-512's 16) run in a child process: before the scalar kernel took them, the vector kernel wrote past
# its stack arrays (the stack protector aborts the process there).
LARGE_HEADS = textwrap.dedent("""
    import math, sys, torch
    from kernels import PagedAttentionMetadata
    from kernels.backends import select_backend
    from kernels.reference import naive_causal_attention
    cpu = select_backend("cpu", torch.device("cpu"))[0]
    d = int(sys.argv[1])
    gen = torch.Generator().manual_seed(d)
    k_pool, v_pool = torch.randn(2, 8, 4, 1, d, generator=gen).unbind(0)  # 8 blocks of 4 slots, 1 KV head
    meta = PagedAttentionMetadata.build([1, 3], [9, 3], [[1, 2, 3], [4]], 4, backend=cpu)
    q = torch.randn(4, 2, d, generator=gen)
    k = k_pool.view(-1, 1, d)[meta.slot_mapping]
    v = v_pool.view(-1, 1, d)[meta.slot_mapping]
    out = cpu.forward(q, k, v, k_pool, v_pool, meta, 1 / math.sqrt(d))
    def context(pool, table, n):
        return pool[torch.tensor(table)].reshape(-1, 1, d)[:n]
    ref = torch.cat([naive_causal_attention(q[:1].double(), context(k_pool, [1, 2, 3], 9).double(),
                                            context(v_pool, [1, 2, 3], 9).double()),
                     naive_causal_attention(q[1:].double(), context(k_pool, [4], 3).double(),
                                            context(v_pool, [4], 3).double())])
    print((out.double() - ref).abs().max().item())
""")


@pytest.mark.parametrize("head_dim", [576, 1152])
def test_head_sizes_past_the_vector_kernel_match_the_reference(head_dim):
    done = subprocess.run([sys.executable, "-c", LARGE_HEADS, str(head_dim)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.split()[-1]) < 1e-5
