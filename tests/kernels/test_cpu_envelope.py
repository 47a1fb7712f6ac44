"""Every compiled CPU kernel at 1, 2, 3, 4 and 8 threads, at the exact widths of real model
configurations (``tests/kernels/model_shapes.py``), against float64 references (``kernels.reference``
where it has one). How work is split between threads is what changes with their number, so more
threads than this machine's cores still check a server's split; the widths are those of the
models, not powers of two (a split that leaves columns to nobody only shows at some widths and
thread counts: 1040 columns at 2, 4 and 8 threads, 200 at 3 and 5, 50272 at 5 only)."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from kernels.reference import naive_rms_norm, naive_rotary
from tests.compiled import cpu_backend_or_skip, threads
from tests.kernels.model_shapes import MODELS, linear_shapes
from tests.kernels.test_cpu_attention import Pool, attend, plan_for, run, shared_batch
from workers.allocator import huge_empty

CPU = cpu_backend_or_skip()
OPS = CPU.layer_ops
THREADS = (1, 2, 3, 4, 8)
LINEAR_THREADS = (1, 2, 3, 4, 5, 8)  # 5: OPT's vocabulary of 50272 columns was split wrong at 5 threads only
LM_HEAD_INPUTS = 64  # the vocabulary's columns at a small depth: the split is over columns, the depths are the layers'
SHAPES = {**linear_shapes(), **{(m.vocab, LM_HEAD_INPUTS): f"{m.name} lm_head" for m in MODELS},
          # the `odd` preset's layers (qkv, gate_up, down, lm head): widths that are no multiple of 64
          (280, 200): "odd qkv", (1040, 200): "odd gate_up", (200, 520): "odd down", (4100, 200): "odd lm_head"}


def rows_over_grain(width: int, least: int = 37) -> int:
    """Enough rows that the elementwise ops (grains of 32768 / width rows) split them over 8 threads."""
    return max(least, 8 * max(1, 32768 // width) + 5)


def assert_within_ulps(got: torch.Tensor, ref: torch.Tensor, ulps: float, floor: float) -> None:
    """|got - ref| <= ulps units in the last place of got's dtype at ref's magnitude, plus ``floor``
    (the float32 arithmetic inside the kernels, at outputs near zero)."""
    eps = torch.finfo(got.dtype).eps
    ref = ref.double()
    bound = ulps * eps * ref.abs() + floor
    err = (got.double() - ref).abs()
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (
        f"{int((err > bound).sum())} of {err.numel()} values off; the worst: {got.flatten()[worst].item()} "
        f"where {ref.flatten()[worst].item()} was due")


@pytest.fixture(scope="module")
def linear_buffers() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Memory for the linear test's weights, shared by its shapes: the first n x k values of ``values``
    (uniform in [-1, 1), drawn once) are the weight of shape (n, k), stored as the transpose of a
    contiguous [k, n] matrix on huge pages, which is the layout ``_transposed_layout`` gives; ``packed``
    takes the shape's packed weight. Drawing and laying out ~800M values afresh per shape took most of
    the test's time (the weights of two shapes overlap; each is still n x k independent values)."""
    largest = max(n * k for n, k in SHAPES)
    values = huge_empty((largest,), torch.float32).uniform_(-1.0, 1.0, generator=torch.Generator().manual_seed(7))
    packed = huge_empty((largest,), torch.float32)
    yield values, packed
    del values, packed


def _reference(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight_t (+ bias) in float64, weight_t [k, n] converted a slice of inputs at a time (the
    float64 copy of a whole 37888 x 3584 weight is a gigabyte): the same float64 sums, in float32."""
    k, n = weight_t.shape
    x64 = x.double()
    ref = torch.zeros(x.shape[0], n, dtype=torch.float64) if bias is None else bias.double().expand(x.shape[0], n).clone()
    step = max(4, (1 << 19) // n)  # a slice of 4 MiB in float64: it stays in cache for its product
    for k0 in range(0, k, step):
        ref.addmm_(x64[:, k0:k0 + step], weight_t[k0:k0 + step].double())
    return ref.float()


# the batches: a decode-sized one at every thread count, a prefill-sized one at two. 31 rows are row
# tiles and a tail in every product, as 67 were (packed: 2 tiles of 12 + 7 on AVX-512, 5 of 6 + 1 on
# AVX2; fixed-order: 7 tiles of 4 + 3) and one row block (at most 120 rows) like them; how the
# columns are split between threads depends on the width and the thread count only, not the rows
DECODE_ROWS, PREFILL_ROWS = 5, 31


@pytest.mark.parametrize("shape", list(SHAPES), ids=[f"{SHAPES[s]}-{s[0]}x{s[1]}" for s in SHAPES])
def test_linear_at_real_widths_and_thread_counts(shape, linear_buffers):
    """The three products a linear layer can run (the column-split BLAS one on the transposed layout,
    the packed one where the panel width divides the outputs, the fixed-order one of deterministic
    mode) give every output column, at every thread count, for decode-sized and prefill-sized batches."""
    n, k = shape
    values, packed_memory = linear_buffers
    gen = torch.Generator().manual_seed(n * 7 + k)
    weight_t = values[:n * k].view(k, n)  # uniform in [-1, 1): the 1 / sqrt(k) scale is put on x instead
    bias = torch.randn(n, generator=gen) if n % 2 == 0 else None  # unwritten columns would keep the bias
    layouts = {"split": weight_t.t()}
    assert layouts["split"].stride() == (1, n)
    if n % OPS.panel_width == 0:
        packed = packed_memory[:n * k].view(n // OPS.panel_width, k, OPS.panel_width)
        OPS.pack_linear_weight(weight_t.t(), packed)
        layouts["packed"] = packed
    batches = ((DECODE_ROWS, LINEAR_THREADS), (PREFILL_ROWS, (3, 8)))
    xs = [torch.randn(rows, k, generator=gen) / math.sqrt(k) for rows, _ in batches]
    # float64 products of both batches in one pass over the weight, compared in float32: the
    # subtraction's rounding is far below the bound
    refs = _reference(torch.cat(xs), weight_t, bias).split([rows for rows, _ in batches])
    for x, ref, (rows, counts) in zip(xs, refs, batches):
        for t in counts:
            with threads(t):
                results = {name: OPS.linear(x, w, bias) for name, w in layouts.items()}
                results["fixed-order"] = OPS.linear_fixed_order(x, layouts["split"], bias)
            for name, got in results.items():
                err = (got - ref).abs().max().item()
                assert err < 2e-4, f"{name} product, {rows} rows at {t} threads: off by {err}"


def _distinct(values) -> list[int]:
    return sorted(set(values))


@pytest.mark.parametrize("hidden", _distinct(m.hidden for m in MODELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_at_real_widths_and_thread_counts(hidden, dtype):
    gen = torch.Generator().manual_seed(hidden)
    rows = rows_over_grain(hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    ulps = 2 if dtype == torch.float32 else 1.5  # float32: the sum of squares' order; half: one rounding and a half
    want_residual = (x.double() + residual.double()).to(dtype)
    for t in THREADS:
        with threads(t):
            normed = OPS.rms_norm(x, weight, 1e-6)
            xs, rs = x.clone(), residual.clone()
            OPS.fused_add_rms_norm(xs, rs, weight, 1e-6)
        assert_within_ulps(normed, naive_rms_norm(x.double(), weight.double(), 1e-6), 8 * ulps, 1e-6)
        assert torch.equal(rs, want_residual), t
        assert_within_ulps(xs, naive_rms_norm(want_residual.double(), weight.double(), 1e-6), 8 * ulps, 1e-6)


@pytest.mark.parametrize("width", _distinct(m.intermediate for m in MODELS))
def test_silu_and_mul_at_real_widths_and_thread_counts(width):
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(rows_over_grain(2 * width), 2 * width, generator=gen) * 4
    gate, up = x.double().chunk(2, dim=-1)
    want = F.silu(gate) * up
    for t in THREADS:
        with threads(t):
            got = OPS.silu_and_mul(x)
        assert_within_ulps(got, want, 8, 1e-6)


@pytest.mark.parametrize("model", MODELS, ids=[m.name for m in MODELS])
def test_rotary_at_real_head_shapes_and_thread_counts(model):
    gen = torch.Generator().manual_seed(model.head_dim)
    d, heads, kv_heads = model.head_dim, model.heads, model.kv_heads
    tokens = rows_over_grain((heads + kv_heads) * d)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.outer(torch.arange(4096, dtype=torch.float64), inv)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()
    want_q = naive_rotary(qkv[:, :heads * d].view(tokens, heads, d).double(), positions, 10000.0)
    want_k = naive_rotary(qkv[:, heads * d:(heads + kv_heads) * d].view(tokens, kv_heads, d).double(), positions,
                          10000.0)
    for t in THREADS:
        work = qkv.clone()
        q, k, v = work.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        with threads(t):
            OPS.rotary_neox_(positions, q, k, cache, d)
        # cos and sin in float32 from the cache: a few float32 roundings on values of magnitude ~1
        torch.testing.assert_close(q.reshape(tokens, heads, d).double(), want_q, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(k.reshape(tokens, kv_heads, d).double(), want_k, atol=2e-6, rtol=1e-5)
        assert torch.equal(v, qkv[:, (heads + kv_heads) * d:]), t


@pytest.mark.parametrize("vocab", _distinct(m.vocab for m in MODELS))
def test_argmax_at_real_vocabularies_and_thread_counts(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows_over_grain(vocab, least=9), vocab, generator=gen)
    logits[0, -1] = 50.0  # the last column (a tail past the vectors) wins a row
    for t in THREADS:
        with threads(t):
            assert torch.equal(OPS.argmax(logits), logits.argmax(dim=-1)), t


def _model_batch(pool: Pool, rng: random.Random):
    """Decodes and prefill chunks after prefixes, two of them sharing 48 tokens of blocks."""
    return shared_batch(pool, [(48, [(1, 61), (1, 50), (7, 77)])],
                        extra=[(1, rng.randint(2, 90)), (19, 19), (5, rng.randint(40, 90)), (1, 3)])


@pytest.mark.parametrize("model", MODELS, ids=[m.name for m in MODELS])
def test_attention_at_real_head_shapes_and_thread_counts(model):
    """float32, with and without the shared-prefix group pass, 1-8 threads."""
    rng = random.Random(model.head_dim * 31 + model.heads)
    pool = Pool(160, 8, model.kv_heads, model.head_dim, seed=model.heads)
    specs, tables = _model_batch(pool, rng)
    cascade = plan_for(specs, tables, 8)
    assert cascade is not None and cascade.num_groups == 1
    for t in THREADS:
        with threads(t):
            plain, _ = run(pool, specs, tables, model.heads)
            grouped, _ = run(pool, specs, tables, model.heads, cascade=cascade)
        assert plain < 1e-5 and grouped < 1e-5, (t, plain, grouped)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model", MODELS, ids=[m.name for m in MODELS])
def test_half_precision_shared_prefix_attention(model, dtype):
    """The group pass and the suffix's merge in half precision: each output within 1.5 units in the
    last place of its exact value (the kernels compute in float32 and round at the end), plus half a
    unit at the values' magnitude: the merge reads the group pass's output back as it was stored,
    rounded to the pool's dtype, and a weighted mean of values can be far smaller than they are."""
    rng = random.Random(model.head_dim)
    pool = Pool(160, 8, model.kv_heads, model.head_dim, dtype=dtype, seed=model.kv_heads)
    specs, tables = _model_batch(pool, rng)
    cascade = plan_for(specs, tables, 8)
    for t in (1, 3, 8):
        with threads(t):
            out, ref = attend(pool, specs, tables, model.heads, cascade=cascade, dtype=dtype, seed=t)
        floor = 0.5 * torch.finfo(dtype).eps * pool.v.float().nan_to_num().abs().max().item()
        assert_within_ulps(out, ref, 1.5, floor)
