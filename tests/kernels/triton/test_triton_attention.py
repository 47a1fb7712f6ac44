"""The Triton paged attention and KV store, under the interpreter, against the naive reference:
block sizes on and off powers of two, contexts ending mid-block and on a block edge, grouped-query
ratios 1-8, head sizes that need padding, null-block padding (NaN there), decodes and prefill chunks
in one batch, a prefix written in the same step, and split-KV."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import PagedAttentionMetadata, paged_attention, select_backend
from kernels.reference import naive_causal_attention
from kernels.triton import TritonAttentionBackend, ops
from tests.kernels.triton.common import Pool, edge_batch, run_step


def test_the_kernels_run_interpreted():
    assert ops.INTERPRETED


@pytest.mark.parametrize("block_size", [1, 5, 8, 16, 32])
@pytest.mark.parametrize("num_heads,kv_heads", [(4, 4), (4, 2), (8, 2), (8, 1)])
def test_mixed_batches_match_reference(block_size, num_heads, kv_heads):
    rng = random.Random(block_size * 100 + num_heads * 10 + kv_heads)
    pool = Pool(300 if block_size == 1 else 60, block_size, kv_heads, 64, seed=rng.randint(0, 99))
    specs, tables = edge_batch(pool, num_decodes=3, num_prefills=2, rng=rng, max_blocks=40 // block_size + 1)
    worst, out = run_step(pool, specs, tables, num_heads, TritonAttentionBackend())
    assert torch.isfinite(out).all()
    assert worst < 1e-5, (specs, worst)


@pytest.mark.parametrize("head_dim", [32, 40, 96, 128])
def test_head_sizes(head_dim):
    pool = Pool(40, 8, 2, head_dim, seed=head_dim)
    specs = [(1, 17), (1, 8), (6, 22)]
    worst, out = run_step(pool, specs, [pool.blocks(s) for _, s in specs], 4, TritonAttentionBackend())
    assert torch.isfinite(out).all() and worst < 1e-5


@pytest.mark.parametrize("seq_len", [15, 16, 17, 32, 33])
def test_contexts_on_and_off_block_edges(seq_len):
    """Decodes and a chunk whose context ends just before, on and just after a block edge (block 16)."""
    pool = Pool(20, 16, 2, 64, seed=seq_len)
    specs = [(1, seq_len), (1, 16), (seq_len - 3, seq_len)]
    worst, out = run_step(pool, specs, [pool.blocks(s) for _, s in specs], 4, TritonAttentionBackend())
    assert torch.isfinite(out).all() and worst < 1e-5


def test_null_block_padding_is_never_read():
    pool = Pool(50, 16, 2, 64)
    tables = [pool.blocks(20), pool.blocks(70), pool.blocks(3)]  # ragged: the table pads with block 0 (NaN)
    assert (PagedAttentionMetadata.build([1, 1, 3], [20, 70, 3], tables, 16).block_tables == 0).sum() == 3 + 4
    worst, out = run_step(pool, [(1, 20), (1, 70), (3, 3)], tables, 8, TritonAttentionBackend())
    assert torch.isfinite(out).all() and worst < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_within_the_rounding_bound(dtype):
    """Within ``attention_bound`` (a spacing of the output plus the softmax weights' rounding), not an
    absolute tolerance (bfloat16 runs the products as sums here: the interpreter's tl.dot misreads
    it; and the interpreter rounds to bfloat16 by truncation, within the bound's one spacing). The
    bound is no looser than the absolute tolerances it replaces for most outputs, and the
    float64 result rounded to the dtype is within half of it."""
    pool = Pool(60, 16, 2, 64, dtype=dtype)
    specs = [(1, 40), (1, 17), (30, 50), (7, 7)]
    worst, out = run_step(pool, specs, [pool.blocks(s) for _, s in specs], 8, TritonAttentionBackend(), dtype=dtype)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert worst <= 1.0, worst
    from tests.kernels.triton.common import attention_bound

    q, k, v = (torch.randn(9, 4, 64, generator=torch.Generator().manual_seed(i)).to(dtype) for i in range(3))
    ref = naive_causal_attention(q.double(), k.double(), v.double(), 0.125)
    bound = attention_bound(q, k, v, 0.125, dtype)
    assert ((ref.to(dtype).double() - ref).abs() <= 0.5 * bound).all()
    assert bound.median() < (2e-3 if dtype == torch.float16 else 2e-2)


@pytest.mark.parametrize("head_dim", [256])
def test_head_size_256_in_its_narrower_prefill_tile(head_dim):
    """Head size 256 takes 32-row prefill tiles (8192 values with the head), not 64."""
    pool = Pool(40, 16, 2, head_dim, seed=7)
    specs = [(1, 40), (45, 60)]
    backend = TritonAttentionBackend()
    worst, out = run_step(pool, specs, [pool.blocks(s) for _, s in specs], 4, backend)
    assert [launch.block_q for launch in backend.last_plan] == [8, 16]  # GQA 2: rows / 2
    assert torch.isfinite(out).all() and worst < 1e-5


def test_same_step_prefix_share_reads_fresh_kv():
    """A request computes a 16-token prefix into block 1 while another, in the same step, shares
    block 1 and computes 4 tokens after it: the store precedes the reads."""
    gen = torch.Generator().manual_seed(1)
    bs, heads, d = 16, 2, 64
    k_pool = torch.full((4, bs, heads, d), float("nan"))
    v_pool = torch.full_like(k_pool, float("nan"))
    k = torch.randn(20, heads, d, generator=gen)
    v = torch.randn(20, heads, d, generator=gen)
    q = torch.randn(16 + 4, heads, d, generator=gen)
    meta = PagedAttentionMetadata.build([16, 4], [16, 20], [[1], [1, 2]], bs, backend=TritonAttentionBackend())
    out = paged_attention(q, torch.cat([k[:16], k[16:]]), torch.cat([v[:16], v[16:]]), k_pool, v_pool, meta, d**-0.5)
    torch.testing.assert_close(out[:16], naive_causal_attention(q[:16], k[:16], v[:16], d**-0.5), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[16:], naive_causal_attention(q[16:], k, v, d**-0.5), atol=1e-5, rtol=1e-5)


def test_split_kv_one_long_and_many_short():
    """One 600-token context among eight short decodes and a chunk after a long prefix: the keys are
    split across programs and merged by log-sum-exp, and the result matches one program per tile."""
    pool = Pool(120, 16, 2, 64, seed=3)
    specs = [(1, 600)] + [(1, n) for n in (1, 5, 16, 17, 30, 31, 33, 47)] + [(5, 460)]
    tables = [pool.blocks(s) for _, s in specs]
    split = TritonAttentionBackend(block_n=32, target_programs=64, min_split_tiles=2)
    worst, out_split = run_step(pool, specs, tables, 8, split)
    launches = split.last_plan
    assert [launch.num_splits for launch in launches] == [
        split.num_splits(9, 2, 600), split.num_splits(1, 2, 460, 5)] == [4, 4]  # 7 wanted: powers of two
    assert torch.isfinite(out_split).all() and worst < 1e-5
    single = TritonAttentionBackend(block_n=32, target_programs=1)
    worst_single, out_single = run_step(pool, specs, tables, 8, single)
    assert [launch.num_splits for launch in single.last_plan] == [1, 1]
    assert worst_single < 1e-5
    torch.testing.assert_close(out_split, out_single, atol=1e-5, rtol=1e-5)


def test_more_splits_than_key_tiles_of_a_short_sequence():
    """Splits of a short context that get no keys weigh nothing in the merge."""
    pool = Pool(40, 4, 1, 64, seed=5)
    specs = [(1, 3), (1, 120), (1, 9)]
    backend = TritonAttentionBackend(block_n=16, target_programs=100, min_split_tiles=1)
    worst, out = run_step(pool, specs, [pool.blocks(s) for _, s in specs], 4, backend)
    assert backend.last_plan[0].num_splits == 8  # 120 keys = 8 tiles of 16; the 3-token context fills one
    assert torch.isfinite(out).all() and worst < 1e-5


def test_store_kv_writes_only_its_slots_and_skips_negative_ones():
    k_pool = torch.zeros(4, 5, 2, 40)
    v_pool = torch.zeros(4, 5, 2, 40)
    kv = torch.randn(4, 3, 2, 40)  # a strided key/value, as the qkv split makes them
    key, value = kv[:, 0], kv[:, 2]
    slots = torch.tensor([5 * 2 + 3, -1, 5 * 3 + 0, 5 * 1 + 4])
    ops.store_kv(key, value, k_pool, v_pool, slots)
    assert torch.equal(k_pool[2, 3], key[0]) and torch.equal(k_pool[3, 0], key[2])
    assert torch.equal(k_pool[1, 4], key[3]) and torch.equal(v_pool[1, 4], value[3])
    assert torch.equal(v_pool[2, 3], value[0])
    assert int((k_pool != 0).any(-1).any(-1).sum()) == 3 and int((v_pool != 0).any(-1).any(-1).sum()) == 3


def test_dtype_mismatch_is_a_clear_error():
    pool = Pool(8, 8, 2, 64)
    meta = PagedAttentionMetadata.build([1], [3], [pool.blocks(3)], 8, backend=TritonAttentionBackend())
    q = torch.randn(1, 4, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="dtypes agree"):
        paged_attention(q, q[:, :2], q[:, :2], pool.k, pool.v, meta, 0.125)


def test_select_backend_triton_under_the_interpreter():
    backend, why = select_backend("triton", torch.device("cpu"))
    assert isinstance(backend, TritonAttentionBackend) and backend.name == "triton"
    assert backend.supports_cascade is False and backend.layer_ops is None
    assert why == "attention backend: triton (asked for, interpreted, in-place paged attention)"
    assert select_backend("auto", torch.device("cpu"))[0].name in ("cpu", "torch")  # auto on CPU: as before


def test_triton_where_it_cannot_run_is_a_clear_error(monkeypatch):
    import kernels.triton as kt

    monkeypatch.setattr(kt, "interpreted", lambda: False)
    with pytest.raises(ValueError, match=r"^attention_backend='triton' cannot run here: on a CPU device Triton runs "
                                         r"only under its interpreter \(set TRITON_INTERPRET=1 before start\)$"):
        select_backend("triton", torch.device("cpu"))
    monkeypatch.setattr(kt, "load_error", lambda: "ModuleNotFoundError: No module named 'triton'")
    with pytest.raises(ValueError, match="Triton does not import .ModuleNotFoundError"):
        select_backend("triton", torch.device("cpu"))
    # auto on CUDA is torch until the Triton kernels have run compiled on a GPU (no device needed to choose)
    backend, why = select_backend("auto", torch.device("cuda"))
    assert backend.name == "torch"
    assert why == "attention backend: torch (on cuda; attention_backend='triton' selects the Triton kernels)"


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match=r"one of \('auto', 'torch', 'cpu', 'triton'\)"):
        select_backend("flash", torch.device("cpu"))


def test_a_metadata_object_refilled_for_the_next_step_gets_a_new_plan():
    import dataclasses

    pool = Pool(40, 8, 2, 64, seed=9)
    backend = TritonAttentionBackend()
    planned = []  # the metadata objects the backend planned for
    plan = backend.plan
    backend.plan = lambda meta, *shape: (planned.append(meta), plan(meta, *shape))[1]
    first_specs = [(1, 9), (12, 12)]
    first_tables = [pool.blocks(s) for _, s in first_specs]
    _, _ = run_step(pool, first_specs, first_tables, 4, backend)
    meta = planned[-1]
    assert [launch.num_tokens for launch in backend.last_plan] == [1, 12]
    # the next step refills the same object in place: one more token for both, now both decodes
    gen = torch.Generator().manual_seed(4)
    nxt = PagedAttentionMetadata.build([1, 1], [10, 13], first_tables, 8, backend=backend)
    for field in dataclasses.fields(nxt):
        if field.name == "backend_plan":
            continue  # the old step's plan stays: its copy of the lengths must notice the refill
        value = getattr(nxt, field.name)
        if isinstance(value, list):
            getattr(meta, field.name)[:] = value  # lists refilled in place
        else:
            setattr(meta, field.name, value)
    q = torch.randn(2, 4, 64, generator=gen)
    kv = torch.randn(2, 2, 2, 64, generator=gen)
    out = paged_attention(q, kv[0], kv[1], pool.k, pool.v, meta, 0.125)
    assert [launch.num_tokens for launch in backend.last_plan] == [2]
    for i, ((_, s), table) in enumerate(zip([(1, 10), (1, 13)], first_tables)):
        k, v = pool.context(table, s)
        ref = naive_causal_attention(q[i:i + 1].double(), k.double(), v.double(), 0.125)
        torch.testing.assert_close(out[i:i + 1].double(), ref, atol=1e-5, rtol=1e-5)
