"""The bf16x3 product on AMX tiles (``gemm_amx.cpp``, ``cpu_matmul_precision="high"``): a weight split
once into bfloat16 hi and lo halves, products from 64 rows on AMX tiles and below by float32
multiply-adds against the rebuilt weight. Against a float64 reference at the widths of real model
configurations, every row count around the two regimes' edges, 1-8 threads: within bf16x3's error
(about 2^-16 of each product, a few 1e-5 of the output's scale), each row's bits those it has alone and
at any number of threads. Runs where the CPU, OS and build grant AMX tiles (Sapphire Rapids and later);
elsewhere the split is refused, which the AVX2 build's test in test_cpu_build.py checks."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import load
from tests.kernels.model_shapes import MODELS
from tests.kernels.test_cpu_envelope import threads

OPS = load()
pytestmark = pytest.mark.skipif(OPS is None or not OPS.amx_usable(),
                                reason="this CPU, OS or kernel build grants no AMX tiles")
AMX_MIN_ROWS = 64


def _split(weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    out = torch.empty(n // 32, 4, k // 2, 16, dtype=torch.int32)
    OPS.split_linear_weight(weight, out)
    return out


def _case(rows: int, k: int, n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    weight = torch.randn(n, k, generator=gen) / k ** 0.5
    bias = torch.randn(n, generator=gen)
    return x, weight, bias


def _error(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> float:
    ref = x.double() @ weight.double().T + bias.double()
    return float((out.double() - ref).abs().max() / ref.abs().max())


# (k, n) of real layers, not only powers of two: Qwen2-0.5B's qkv (896 -> 1152), down (4864 -> 896),
# Phi-3's qkv rows (3072 -> 96 heads of 96 = 9216 is large: its o, 3072 -> 3072), OPT's fc1 (768 -> 3072),
# the smallest depth (32) and one of 5 blocks of 32 (160)
WIDTHS = [(896, 1152), (4864, 896), (768, 3072), (3072, 3072), (32, 64), (160, 96)]


@pytest.mark.parametrize("k,n", WIDTHS)
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 63, 64, 65, 130, 257])
def test_within_bf16x3_error_at_real_widths(rows, k, n):
    x, weight, bias = _case(rows, k, n)
    with threads(2):
        out = OPS.linear(x, _split(weight), bias)
    assert out.shape == (rows, n)
    # measured: 0.9-1.1e-5 from 64 rows (three bfloat16 products), 3-4.5e-6 below (weights rebuilt to
    # ~16 bits, float32 products); float32's own product 0.3-3.5e-6
    assert _error(out, x, weight, bias) < (3e-5 if rows >= AMX_MIN_ROWS else 1e-5)


def test_the_split_keeps_sixteen_bits_of_each_weight():
    """A weight whose values have at most 16 significant bits is rebuilt exactly: below 64 rows the
    product of such weights and small-integer inputs is exact in float32, as float32's own is."""
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randint(-2**15, 2**15, (96, 64), generator=gen).float() * 2.0 ** -10)
    x = torch.randint(-4, 5, (5, 64), generator=gen).float()
    out = OPS.linear(x, _split(weight), None)
    assert torch.equal(out, (x.double() @ weight.double().T).float())


def _split_reference(weight: torch.Tensor) -> torch.Tensor:
    """The split layout computed in torch: per panel of 32 columns four streams (hi of columns 0-15, of
    16-31, lo of 0-15, of 16-31), each word an input pair (the even input in the low 16 bits); hi = the
    top 16 bits, lo = x - hi rounded to bfloat16 (nearest, ties to even), 0 where x is not finite."""
    n, k = weight.shape
    bits = weight.view(torch.int32).long() & 0xFFFFFFFF
    hi = bits >> 16
    rest = weight - (bits & 0xFFFF0000).to(torch.int32).view(torch.float32)
    lo = rest.to(torch.bfloat16).view(torch.int16).long() & 0xFFFF
    lo = torch.where(weight.isfinite(), lo, torch.zeros_like(lo))

    def words(half: torch.Tensor) -> torch.Tensor:  # [n, k] -> [n / 32, 2, k / 2, 16]
        pairs = half.reshape(n // 32, 2, 16, k // 2, 2)
        return (pairs[..., 0] | pairs[..., 1] << 16).permute(0, 1, 3, 2)

    split = torch.cat([words(hi), words(lo)], dim=1)
    return (split - (split >> 31) * 2**32).to(torch.int32)


def test_the_split_layout_bit_for_bit():
    """Every word of the split weight, against the layout computed in torch: normal values of every
    scale, subnormals, signed zeros, infinities and NaN, from a weight in either memory order."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(96, 160, generator=gen) * torch.exp2(torch.randint(-140, 120, (96, 160), generator=gen).float())
    weight.view(-1)[:6] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45])
    want = _split_reference(weight)
    assert torch.equal(_split(weight), want)
    assert torch.equal(_split(weight.T.contiguous().T), want)  # column-major: the strides are honoured


@pytest.mark.parametrize("num_threads", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("k,n", [(896, 1152), (2048, 256)])
def test_rows_do_not_depend_on_the_batch_or_the_threads(num_threads, k, n):
    """In each regime a row's bits are those it has alone and at one thread: 300 rows (row blocks of
    128, a last partial one), any slice of 64 or more of them; 40 rows, any slice of them."""
    for rows, slices in ((300, [(0, 64), (17, 81), (236, 300), (100, 229)]), (40, [(0, 1), (3, 11), (39, 40)])):
        x, weight, bias = _case(rows, k, n, seed=num_threads)
        split = _split(weight)
        with threads(1):
            want = OPS.linear(x, split, bias)
        with threads(num_threads):
            assert torch.equal(OPS.linear(x, split, bias), want)
            for a, b in slices:
                assert torch.equal(OPS.linear(x[a:b].contiguous(), split, bias), want[a:b]), (rows, a, b)


@pytest.mark.parametrize("shape", MODELS, ids=lambda s: s.name)
def test_every_layer_of_real_models_at_prefill_rows(shape):
    """Each linear layer of the real configurations (output features a multiple of 32; depths cut to
    1024 inputs to bound the test's time: the passes of 1024 are covered by WIDTHS' 3072 and 4864)."""
    for name, (n, k) in shape.linears.items():
        n, k = min(n, 1024) // 32 * 32, min(k, 1024)
        x, weight, bias = _case(96, k, n)
        with threads(3):
            assert _error(OPS.linear(x, _split(weight), bias), x, weight, bias) < 3e-5, (shape.name, name)


def test_bad_shapes_are_refused_in_one_sentence():
    weight = torch.randn(64, 96)
    split = _split(weight)
    for width in (64, 95, 97, 128):  # the exact width: none within a block of 32 of it is taken
        with pytest.raises(RuntimeError, match=f"x has {width} features where the split weight takes 96"):
            OPS.linear(torch.randn(3, width), split, None)
    with pytest.raises(RuntimeError, match="multiple of 32 output features"):
        OPS.split_linear_weight(torch.randn(48, 64), torch.empty(1, 4, 32, 16, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="positive multiple of 32 input features, not 100"):
        OPS.split_linear_weight(torch.randn(64, 100), torch.empty(2, 4, 64, 16, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="no fixed-order linear"):
        OPS.linear_fixed_order(torch.randn(3, 96), split, None)


def test_a_layer_whose_inputs_32_does_not_divide_stays_packed_float32():
    """The split takes whole blocks of 32 inputs: binding a layer of 100 inputs under "high" gives the
    packed float32 layout, whose product is float32's, while one of 96 is split."""
    from kernels.cpu.layer_ops import CpuLayerOps
    from workers.layers.kernels import _relaid

    ops = CpuLayerOps(OPS, attention_args=None)
    kept = _relaid(torch.randn(64, 100), ops, "split")
    assert kept.dtype == torch.float32 and kept.shape == (64 // ops.panel_width, 100, ops.panel_width)
    assert _relaid(torch.randn(64, 96), ops, "split").shape == (2, 4, 48, 16)


def test_products_from_two_threads_at_once_keep_their_own_rows():
    """The split copy of a product's rows is one per process (the memory plan counts one, and a rank's
    steps run on two threads under the compiled graph); two threads multiplying at once (two engines in
    one process) take turns with it: each gets, every time, the bits it gets alone."""
    import threading

    cases = [_case(rows, k, 256, seed=rows) for rows, k in ((300, 896), (130, 2048))]
    splits = [_split(weight) for _, weight, _ in cases]
    with threads(2):
        want = [OPS.linear(x, split, bias) for (x, _, bias), split in zip(cases, splits)]
        wrong, done, raised, start = [], [], [], threading.Barrier(2)

        def multiply(i: int) -> None:
            (x, _, bias), split = cases[i], splits[i]
            start.wait()
            try:
                for _ in range(40):
                    if not torch.equal(OPS.linear(x, split, bias), want[i]):
                        wrong.append(i)
                    done.append(i)
            except Exception as exc:  # noqa: BLE001 - a thread's error would otherwise pass unseen
                raised.append(exc)

        runners = [threading.Thread(target=multiply, args=(i,)) for i in range(2)]
        for runner in runners:
            runner.start()
        for runner in runners:
            runner.join()
    assert raised == [] and wrong == [] and sorted(done) == [0] * 40 + [1] * 40
