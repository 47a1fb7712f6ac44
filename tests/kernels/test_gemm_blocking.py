"""The packed product's blocking (kernels/cpu/gemm.cpp): row tiles, row blocks split evenly, column
blocks of 128 columns and depth passes of 192 (gemm.h's kDepth), at tails of each and at the widths of real models,
against float64 products; its batch invariance at several thread counts where the work is split by
row blocks; and the FMA peak op the benchmark measures against."""

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
ROW_BLOCK = 20 * TILE


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


# rows around the tile and the row block (a block of ROW_BLOCK rows, the tiles of more split evenly
# into blocks); depths around one and two passes of 192; a width that is one column block and a panel
@pytest.mark.parametrize("rows", [1, TILE - 1, TILE + 1, ROW_BLOCK - 1, ROW_BLOCK + 1, 2 * ROW_BLOCK + TILE + 3, 517])
@pytest.mark.parametrize("k", [1, 7, 191, 193, 385, 513])
def test_tails_of_tiles_blocks_and_passes(rows, k):
    _check(rows, k, 128 + PANEL)


# the outputs of real configurations (Qwen2-0.5B's 896, 4864 and 1152; a Llama-ish 5632; OPT's
# vocabulary 50272, at a small depth) at decode and prefill batches
@pytest.mark.parametrize("k,n", [(896, 4864), (4864, 896), (896, 1152), (256, 5632), (64, 50272)])
@pytest.mark.parametrize("rows", [3, 301])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_real_widths(k, n, rows, threads):
    _check(rows, k, n, threads, bias=n % 2 == 0)


@pytest.mark.parametrize("threads", [1, 2, 3, 4, 8])
def test_rows_do_not_depend_on_the_batch_across_row_blocks(threads):
    """Many rows split the work by row blocks (each thread's rows against every panel): a row's bits
    are still those it has alone, in any slice of the batch and at any number of threads."""
    gen = torch.Generator().manual_seed(11)
    rows, k, n = 3 * ROW_BLOCK + 17, 600, 5 * PANEL + 128
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


def test_fma_peak_is_a_rate():
    one = OPS.ops.fma_peak(100_000)
    assert math.isfinite(one) and one > 0.1
    with _threads(2):
        both = OPS.ops.fma_peak(100_000, True)
    assert math.isfinite(both) and both > 0.1
