"""The packed product's blocking (kernels/cpu/gemm.cpp): row tiles, row blocks split evenly (120, 240 or
360 rows, from the L2's size), a panel or a column block (256 or 512 columns) at a time, depth passes
cut evenly into at most 256 inputs (gemm.h's kDepth; one pass for a single row tile) and the copy of
a's rows (a transpose W inputs at a time, one input at a time past the last multiple of W and in a
tile of fewer rows), at tails of each and at the widths of real models, against float64 products;
its batch invariance at several thread counts where the work is split by row blocks and by panels;
and the FMA peak op the benchmark measures against."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.compiled import cpu_backend_or_skip

CPU = cpu_backend_or_skip()
OPS = CPU.layer_ops
PANEL = OPS.panel_width
TILE = 12 if PANEL == 32 else 6  # rows per register tile (gemm.h)
ROW_BLOCK = 360  # the most rows per row block (gemm.cpp's blocking(); 240 or 120 where the L2 is smaller)


def _packed(weight: torch.Tensor) -> torch.Tensor:
    out = torch.empty(weight.shape[0] // PANEL, weight.shape[1], PANEL)
    OPS.pack_linear_weight(weight, out)
    return out


def _threads(n: int):
    class _Scope:
        def __enter__(self):
            self.previous = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc):
            torch.set_num_threads(self.previous)

    return _Scope()


def _check(rows: int, k: int, n: int, threads: int = 2, bias: bool = True) -> None:
    gen = torch.Generator().manual_seed(rows * 131 + k * 7 + n)
    x = torch.randn(rows, k, generator=gen)
    weight = torch.empty(n, k).uniform_(-1.0, 1.0, generator=gen) / math.sqrt(k)
    b = torch.randn(n, generator=gen) if bias else None
    want = F.linear(x.double(), weight.double(), None if b is None else b.double())
    with _threads(threads):
        got = OPS.linear(x, _packed(weight), b)
    assert got.shape == (rows, n)
    err = (got.double() - want).abs().max().item()
    assert err < 2e-5 * math.sqrt(k) + 1e-5, f"{rows} rows, {k}x{n}, {threads} threads: off by {err}"


# rows around the tile and the row blocks of every L2 size (blocks of at most 120, 240 or 360 rows, the
# tiles of more split evenly into blocks); depths around one and two passes (256: one; 257: two of 132
# and 125) and past the W-input transposes of the copy of a (W - 1, W + 1, 77); widths around the
# column blocks of 256 and 512 columns
@pytest.mark.parametrize("rows", [1, TILE - 1, TILE + 1, 121, 239, 241, ROW_BLOCK - 1, ROW_BLOCK + 1,
                                  2 * ROW_BLOCK + TILE + 3, 517])
@pytest.mark.parametrize("k", [1, 7, 15, 17, 77, 255, 257, 513, 1000])
def test_tails_of_tiles_blocks_and_passes(rows, k):
    _check(rows, k, 512 + PANEL)


# a row block whose copy of a stays in L2 runs one panel at a time (depth 300), one whose copy is
# larger (1000) a column block at a time: widths around column blocks of 256 and 512 columns
@pytest.mark.parametrize("n", [PANEL, 256 - PANEL, 256 + PANEL, 1024 + 3 * PANEL])
@pytest.mark.parametrize("k", [300, 1000])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_column_blocks(n, k, threads):
    _check(ROW_BLOCK - 1, k, n, threads)


# the outputs of real configurations (Qwen2-0.5B's 896, 4864 and 1152; a Llama-ish 5632; OPT's
# vocabulary 50272, at a small depth; this project's Qwen3 small preset: qkv 512x1536, o 1024x512,
# gate/up 512x2816, down 1408x512; depths of 1000 and 77, an odd number of panels) at decode and
# prefill batches
@pytest.mark.parametrize("k,n", [(896, 4864), (4864, 896), (896, 1152), (256, 5632), (64, 50272), (512, 1536),
                                 (1024, 512), (512, 2816), (1408, 512), (1000, 31 * PANEL), (77, 992)])
@pytest.mark.parametrize("rows", [3, 301])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_real_widths(k, n, rows, threads):
    _check(rows, k, n, threads, bias=n % 2 == 0)


@pytest.mark.parametrize("threads", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("k", [600, 1500])
def test_rows_do_not_depend_on_the_batch_across_row_blocks(threads, k):
    """Many rows split the work by row blocks (each thread's rows against every panel): a row's bits
    are still those it has alone, in any slice of the batch and at any number of threads (depth 600:
    the row blocks' copies stay in L2, a panel at a time; 1500: a column block at a time)."""
    gen = torch.Generator().manual_seed(11)
    rows, n = 3 * ROW_BLOCK + 17, 5 * PANEL + 512
    x = torch.randn(rows, k, generator=gen)
    packed = _packed(torch.randn(n, k, generator=gen))
    bias = torch.randn(n, generator=gen)
    with _threads(1):
        alone = torch.cat([OPS.linear(x[i:i + 1], packed, bias) for i in range(0, rows, 37)])
    with _threads(threads):
        full = OPS.linear(x, packed, bias)
        for lo, hi in [(0, ROW_BLOCK + 1), (5, 2 * ROW_BLOCK + 9), (ROW_BLOCK - 3, rows)]:
            assert torch.equal(OPS.linear(x[lo:hi], packed, bias), full[lo:hi]), (lo, hi)
    assert torch.equal(full[::37], alone)


@pytest.mark.parametrize("rows", [1, 5, TILE, 64, 300])
@pytest.mark.parametrize("n", [512, 1408])
def test_rows_do_not_depend_on_the_threads(rows, n):
    """Few rows split the work by panels (each thread a range of the panels), more by row blocks, and
    a single row block of 16 tiles or more of at most 1024 columns into one row block per thread: at
    any number of threads every bit is the same, and a row's bits are those it has alone."""
    gen = torch.Generator().manual_seed(rows)
    k = 1000
    x = torch.randn(rows, k, generator=gen)
    packed = _packed(torch.randn(n, k, generator=gen))
    bias = torch.randn(n, generator=gen)
    with _threads(1):
        want = OPS.linear(x, packed, bias)
        alone = OPS.linear(x[-1:], packed, bias)
    assert torch.equal(want[-1:], alone)
    for threads in (2, 3, 4, 8):
        with _threads(threads):
            assert torch.equal(OPS.linear(x, packed, bias), want), threads


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_outputs_larger_than_the_caches_are_streamed(threads):
    """An output of more than four L2s (13.6 MB here) is written past the caches: the same bits as the
    rows written through them in a smaller product, and as a float64 product."""
    gen = torch.Generator().manual_seed(5)
    rows, k, n = 700, 96, 4864
    x = torch.randn(rows, k, generator=gen)
    weight = torch.randn(n, k, generator=gen) / math.sqrt(k)
    packed = _packed(weight)
    bias = torch.randn(n, generator=gen)
    with _threads(threads):
        full = OPS.linear(x, packed, bias)
        few = OPS.linear(x[:100], packed, bias)
    assert torch.equal(full[:100], few)
    want = F.linear(x.double(), weight.double(), bias.double())
    assert (full.double() - want).abs().max().item() < 2e-5 * math.sqrt(k) + 1e-5


def test_fma_peak_is_a_rate():
    one = OPS.ops.fma_peak(100_000)
    assert math.isfinite(one) and one > 0.1
    with _threads(2):
        both = OPS.ops.fma_peak(100_000, True)
    assert math.isfinite(both) and both > 0.1
