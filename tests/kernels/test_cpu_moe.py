"""The compiled mixture-of-experts op (``moe.cpp``) and the plain-torch one (``kernels.torch_moe``)
against a per-token float64 reference, at 1, 2, 3, 4 and 8 threads and at widths that are no
multiple of the panel width; the compiled op's rows do not depend on the batch (bitwise); pairs
routed to other ranks' experts add nothing; the router as transformers computes it. Experts split for
the bf16x3 product (``moe_split_weight``, ``cpu_matmul_precision="high"``): within its error below and
from 64 rows per expert, at 1-4 threads, beside packed weights, under expert parallelism, laid out as
linear weights are, refused where they cannot run, and chosen by the binding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu.layer_ops import lay_out_expert_weight
from kernels.torch_moe import moe_experts, select_experts
from tests.compiled import cpu_backend_or_skip, threads

OPS = cpu_backend_or_skip().layer_ops
THREADS = (1, 2, 3, 4, 8)
# (hidden, intermediate per rank, experts, top k): the tiny presets, the odd preset (200 wide, its 136
# split over two ranks), a Qwen3-MoE-like many-small-experts shape, and widths of one vector or less
SHAPES = [(64, 48, 8, 2), (200, 68, 6, 2), (200, 136, 6, 2), (128, 40, 16, 4), (33, 7, 3, 3), (16, 8, 4, 1)]


def reference(x, w13, w2, weights, ids, expert_start=0):
    """Token by token, slot by slot, in float64."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s]) - expert_start
            if 0 <= e < w13.shape[0]:
                h = w13[e] @ x[t]
                out[t] += float(weights[t, s]) * (w2[e] @ (F.silu(h[:inter]) * h[inter:]))
    return out


def problem(tokens, hidden, inter, experts, top_k, seed=0, local=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    router = torch.randn(experts, hidden, generator=g) * hidden ** -0.5
    weights, ids = select_experts(x @ router.t(), top_k, renormalize=True)
    n = local or experts
    w13 = torch.randn(n, 2 * inter, hidden, generator=g) * hidden ** -0.5
    w2 = torch.randn(n, hidden, inter, generator=g) * inter ** -0.5
    return x, w13, w2, weights, ids


def compiled(x, w13, w2, weights, ids, expert_start=0):
    return OPS.moe_experts(x, OPS.moe_pack_weight(w13), OPS.moe_pack_weight(w2), weights, ids, expert_start,
                           w2.shape[2])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_compiled_and_torch_match_the_reference_at_every_thread_count(shape):
    hidden, inter, experts, top_k = shape
    for tokens in (1, 5, 37):
        x, w13, w2, weights, ids = problem(tokens, hidden, inter, experts, top_k, seed=tokens)
        expected = reference(x, w13, w2, weights, ids)
        torch.testing.assert_close(moe_experts(x, w13, w2, weights, ids).double(), expected, rtol=1e-5, atol=1e-5)
        results = []
        for n in THREADS:
            with threads(n):
                results.append(compiled(x, w13, w2, weights, ids))
            torch.testing.assert_close(results[-1].double(), expected, rtol=1e-5, atol=1e-5)
        assert all(torch.equal(r, results[0]) for r in results), "the thread count changed a bit"


@pytest.mark.parametrize("inter", [768, 192], ids=["qwen3-30b-a3b", "qwen3-30b-a3b-tp4"])
def test_real_expert_widths(inter):
    """Qwen3-30B-A3B's expert (hidden 2048, intermediate 768, and its quarter at tensor-parallel size
    4), four of them, a decode and a few rows, at every thread count."""
    for tokens in (1, 6):
        x, w13, w2, weights, ids = problem(tokens, 2048, inter, 4, 2, seed=tokens)
        expected = reference(x, w13, w2, weights, ids)
        for n in THREADS:
            with threads(n):
                torch.testing.assert_close(compiled(x, w13, w2, weights, ids).double(), expected, rtol=1e-5,
                                           atol=1e-5)


@pytest.mark.parametrize("num_threads", [1, 2, 4])
def test_a_rows_result_does_not_depend_on_its_batch(num_threads):
    """Each token computed alone and inside batches of other tokens (other experts' loads, its rows at
    other places in its experts' products; whole experts per thread for few rows, the products split
    across threads for 150 tokens' ~50 rows per expert): the same bits."""
    x, w13, w2, weights, ids = problem(150, 200, 68, 6, 2, seed=3)
    with threads(num_threads):
        whole = compiled(x, w13, w2, weights, ids)
        for t in (0, 17, 149):
            alone = compiled(x[t:t + 1], w13, w2, weights[t:t + 1], ids[t:t + 1])
            assert torch.equal(alone[0], whole[t])
        for a, b in ((10, 30), (0, 61)):
            assert torch.equal(compiled(x[a:b], w13, w2, weights[a:b], ids[a:b]), whole[a:b])
    torch.testing.assert_close(whole.double(), reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_other_ranks_experts_add_nothing():
    """Expert parallelism: ranks holding experts [0, 3) and [3, 6) sum to the whole; a token all of
    whose experts are elsewhere gets zeros."""
    x, w13, w2, weights, ids = problem(23, 200, 136, 6, 2, seed=5)
    whole = reference(x, w13, w2, weights, ids)
    halves = [compiled(x, w13[s:s + 3].contiguous(), w2[s:s + 3].contiguous(), weights, ids, s) for s in (0, 3)]
    plain = [moe_experts(x, w13[s:s + 3], w2[s:s + 3], weights, ids, s) for s in (0, 3)]
    for got in (halves, plain):
        torch.testing.assert_close((got[0] + got[1]).double(), whole, rtol=1e-5, atol=1e-5)
    elsewhere = (ids >= 3).all(dim=1)
    assert elsewhere.any() and (~elsewhere).any()
    assert torch.equal(halves[0][elsewhere], torch.zeros_like(halves[0][elsewhere]))
    torch.testing.assert_close(halves[0][~elsewhere].double(), reference(
        x[~elsewhere], w13[:3], w2[:3], weights[~elsewhere], ids[~elsewhere]), rtol=1e-5, atol=1e-5)


def test_packing_pads_to_the_panel_width():
    w = torch.randn(3, 40, 24)
    packed = OPS.moe_pack_weight(w)
    panel = OPS.panel_width
    assert packed.shape == (3, -(-40 // panel), 24, panel)
    unpacked = packed.permute(0, 1, 3, 2).reshape(3, -1, 24)
    assert torch.equal(unpacked[:, :40], w) and not unpacked[:, 40:].any()


def test_router_as_transformers_computes_it():
    """Softmax over all experts in float32, the top k, renormalised over the chosen (Mixtral) or not
    (Qwen3-MoE without norm_topk_prob)."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0], [3.0, 2.5, 0.0, -3.0]], dtype=torch.bfloat16)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = select_experts(logits, 2, renormalize=False)
    assert weights.dtype == torch.float32 and ids.tolist() == [[1, 3], [0, 1]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    weights, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(dim=1), torch.ones(2))
    torch.testing.assert_close(weights[1], probs[1, :2] / probs[1, :2].sum())


# ---- experts split for the bf16x3 product (cpu_matmul_precision="high"; moe_split_weight) ----
# Where the CPU, OS or build grants no AMX tiles the split is refused, and each test checks that refusal
# instead of skipping (the AVX2 build runs this file in test_cpu_build.py and wants no skips); nothing
# ever asks for a split there (bind_cpu_kernels keeps the packed layout).
AMX = OPS.amx_usable
AMX_MIN_ROWS = 64  # gemm.h's kAmxMinRows: an expert's product of this many rows or more runs on AMX tiles
NO_AMX = "the bf16x3 product needs AMX tiles, which this CPU, OS or build does not grant"
# |out - reference| / max |reference|: the dense bf16x3 tests' bounds (test_gemm_amx.py: 3e-5 on AMX tiles,
# 1e-5 below kAmxMinRows rows), one for each of an expert's two products (down's input carries gate|up's
# error): measured at most 4.4e-5 and 1.3e-5 over these shapes and row counts (four seeds each)
SPLIT_TOL, SPLIT_TOL_FEW_ROWS = 2 * 3e-5, 2 * 1e-5
# (hidden, intermediate, experts, top k): widths that are no power of two; w13 split where 32 divides
# hidden, w2 where it divides intermediate, the other packed: both split, gate|up of 80 padded to 96
# beside a packed down, a packed gate|up beside a split down of 200 features padded to 224
SPLIT_SHAPES = [(96, 96, 4, 2), (160, 224, 6, 2), (96, 40, 4, 2), (200, 96, 4, 2), (160, 224, 8, 3)]


def assert_split_refused():
    with pytest.raises(RuntimeError, match=NO_AMX):
        OPS.moe_split_weight(torch.randn(2, 64, 96))


def laid_out(w):
    """w's expert weight as moe_experts takes it under "high": split where 32 divides its inputs, else packed."""
    return lay_out_expert_weight(OPS, w, split=True)[0]


def skewed_problem(tokens, hidden, inter, experts, top_k, seed=0):
    """``problem`` routed with a skew towards the first experts: the first get far more rows than the
    last (from 150 tokens, 64 rows or more for some experts and fewer for others in one batch)."""
    x, w13, w2, _, _ = problem(tokens, hidden, inter, experts, top_k, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    logits = torch.randn(tokens, experts, generator=g) + torch.linspace(1.5, -1.5, experts)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


def batched_reference(x, w13, w2, weights, ids, expert_start=0):
    """``reference`` expert by expert (each expert's rows in one float64 product): as exact, faster."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        tok, slot = (ids == e + expert_start).nonzero(as_tuple=True)
        h = x[tok] @ w13[e].T
        out.index_add_(0, tok, weights[tok, slot].double()[:, None] * ((F.silu(h[:, :inter]) * h[:, inter:]) @ w2[e].T))
    return out


def test_the_batched_reference_is_the_reference():
    x, w13, w2, weights, ids = problem(23, 160, 40, 6, 3, seed=2)
    for start in (0, 3):
        torch.testing.assert_close(batched_reference(x, w13[start:start + 3], w2[start:start + 3], weights, ids, start),
                                   reference(x, w13[start:start + 3], w2[start:start + 3], weights, ids, start),
                                   rtol=1e-12, atol=1e-12)


def split_error(out, expected):
    return float((out.double() - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("shape", SPLIT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_split_experts_within_bf16x3_error_at_every_thread_count(shape):
    """Rows per expert below kAmxMinRows only (1, 9, 40 tokens), and both below and from it in one batch
    (150, 300 tokens): within the bound of their regime against the float64 reference, the same bits at
    1-4 threads (decodes: whole experts per thread; more rows: each product across the threads), and
    not the float32 product's bits (the split product ran)."""
    if not AMX:
        return assert_split_refused()
    hidden, inter, experts, top_k = shape
    regimes = set()
    for tokens in (1, 9, 40, 150, 300):
        x, w13, w2, weights, ids = skewed_problem(tokens, hidden, inter, experts, top_k, seed=tokens)
        rows = torch.bincount(ids.flatten(), minlength=experts)
        regimes.add((bool((rows < AMX_MIN_ROWS).any()), bool(rows.max() >= AMX_MIN_ROWS)))
        expected = batched_reference(x, w13, w2, weights, ids)
        w13s, w2s = laid_out(w13), laid_out(w2)
        results = []
        for n in (1, 2, 3, 4):
            with threads(n):
                results.append(OPS.moe_experts(x, w13s, w2s, weights, ids, 0, inter))
        assert all(torch.equal(r, results[0]) for r in results), "the thread count changed a bit"
        bound = SPLIT_TOL if rows.max() >= AMX_MIN_ROWS else SPLIT_TOL_FEW_ROWS
        assert split_error(results[0], expected) < bound, (tokens, rows.tolist())
        assert not torch.equal(results[0], compiled(x, w13, w2, weights, ids))
    assert regimes == {(True, False), (True, True)}  # the cases cover both regimes, mixed in a batch too


def test_split_expert_parallel_ranks():
    """Expert parallelism with split weights: ranks holding experts [0, 3) and [3, 6) (the second at
    expert_start 3) sum to the whole within the bound; a token all of whose experts are elsewhere gets
    zeros; at 300 tokens every expert has 64 rows or more, at 23 none."""
    if not AMX:
        return assert_split_refused()
    for tokens in (23, 300):
        x, w13, w2, weights, ids = problem(tokens, 160, 96, 6, 2, seed=5)
        whole = batched_reference(x, w13, w2, weights, ids)
        rows = torch.bincount(ids.flatten(), minlength=6)
        with threads(2):
            halves = [OPS.moe_experts(x, laid_out(w13[s:s + 3].contiguous()), laid_out(w2[s:s + 3].contiguous()),
                                      weights, ids, s, 96) for s in (0, 3)]
        bound = SPLIT_TOL if rows.max() >= AMX_MIN_ROWS else SPLIT_TOL_FEW_ROWS
        assert split_error(halves[0] + halves[1], whole) < bound
        assert ((rows >= AMX_MIN_ROWS).all() if tokens == 300 else (rows < AMX_MIN_ROWS).all()), rows.tolist()
        elsewhere = (ids >= 3).all(dim=1)
        assert elsewhere.any() and (~elsewhere).any()
        assert torch.equal(halves[0][elsewhere], torch.zeros_like(halves[0][elsewhere]))
        mine = batched_reference(x[~elsewhere], w13[:3], w2[:3], weights[~elsewhere], ids[~elsewhere])
        assert split_error(halves[0][~elsewhere], mine) < bound


def test_the_split_lays_out_each_expert_as_a_linear_weight():
    """Expert e of moe_split_weight is split_linear_weight of its matrix with zero rows to a multiple of
    32 output features, word for word (40 features -> 64; 64 stay 64)."""
    if not AMX:
        return assert_split_refused()
    g = torch.Generator().manual_seed(7)
    for n in (40, 64):
        w = torch.randn(3, n, 96, generator=g)
        split = OPS.moe_split_weight(w)
        assert split.dtype == torch.int32 and split.shape == (3, -(-n // 32), 4, 48, 16) and split.is_contiguous()
        for e in range(3):
            padded = torch.zeros(split.shape[1] * 32, 96)
            padded[:n] = w[e]
            want = torch.empty(split.shape[1:], dtype=torch.int32)
            OPS.split_linear_weight(padded, want)
            assert torch.equal(split[e], want), (n, e)


def test_split_weights_refused_in_one_sentence():
    with pytest.raises(RuntimeError, match="moe_split_weight needs a positive multiple of 32 input features, not 100"):
        OPS.moe_split_weight(torch.randn(2, 64, 100))
    with pytest.raises(RuntimeError, match=r"moe_split_weight takes a float32 \[E, N, K\] weight"):
        OPS.moe_split_weight(torch.randn(64, 96))
    with pytest.raises(RuntimeError, match=r"moe_split_weight takes a float32 \[E, N, K\] weight"):
        OPS.moe_split_weight(torch.randn(2, 64, 96, dtype=torch.bfloat16))
    x, w13, w2, weights, ids = problem(5, 96, 96, 4, 2)
    bad = torch.zeros(4, 3, 2, 48, 16, dtype=torch.int32)  # a 5-D int32 tensor of no split's shape
    with pytest.raises(RuntimeError, match="moe_experts takes weights packed by moe_pack_weight or split by "
                                           "moe_split_weight"):
        OPS.moe_experts(x, bad, OPS.moe_pack_weight(w2), weights, ids, 0, 96)
    if not AMX:
        assert_split_refused()
        split_like = torch.zeros(4, 6, 4, 48, 16, dtype=torch.int32)  # what a split of w13 would be
        with pytest.raises(RuntimeError, match="moe_experts: a weight split for the bf16x3 product needs a CPU and "
                                               "OS that grant AMX tiles"):
            OPS.moe_experts(x, split_like, OPS.moe_pack_weight(w2), weights, ids, 0, 96)
        return
    w13s, w2s = OPS.moe_split_weight(w13), OPS.moe_split_weight(w2)
    with pytest.raises(RuntimeError, match="do not fit hidden 96 and intermediate 64"):
        OPS.moe_experts(x, w13s, w2s, weights, ids, 0, 64)  # down's split takes 96 inputs
    with pytest.raises(RuntimeError, match="do not fit hidden 64 and intermediate 96"):
        OPS.moe_experts(x[:, :64].contiguous(), w13s, w2s, weights, ids, 0, 96)
    with pytest.raises(RuntimeError, match="do not fit hidden"):
        OPS.moe_experts(x, w13s, OPS.moe_split_weight(w2[:3].contiguous()), weights, ids, 0, 96)  # 4 and 3 experts


@pytest.mark.parametrize("inter", [48, 96])
def test_binding_under_high_splits_the_experts_and_says_bf16x3(inter):
    """bind_cpu_kernels on a layer whose only splittable weights are its experts (the router's 8 outputs
    stay float32): "high" splits w13 (64 inputs) and w2 where 32 divides its inputs (96, not 48), and
    reports bf16x3 for them alone; "highest" and deterministic mode pack both and report float32; the
    layer's output is the reference's within the bound. Without AMX tiles "high" packs both too."""
    from workers.layers.kernels import bind_cpu_kernels
    from workers.layers.moe import FusedMoE
    from workers.parallel_state import TPGroup

    x, w13, w2, _, _ = problem(40, 64, inter, 8, 2, seed=9)
    gate = torch.randn(8, 64, generator=torch.Generator().manual_seed(10)) * 64 ** -0.5
    weights, ids = select_experts(x @ gate.t(), 2, renormalize=True)
    expected = batched_reference(x, w13, w2, weights, ids)
    for precision, deterministic in (("high", False), ("highest", False), ("high", True)):
        layer = FusedMoE(8, 2, 64, inter, True, "silu", TPGroup(), torch.float32, torch.device("cpu"))
        layer.gate.weight.data.copy_(gate)
        layer.w13_weight.data.copy_(w13)
        layer.w2_weight.data.copy_(w2)
        model = torch.nn.Sequential(layer)
        matmul = bind_cpu_kernels(model, OPS, deterministic=deterministic, precision=precision)
        split = AMX and precision == "high" and not deterministic
        assert matmul == ("bf16x3" if split else "float32"), (precision, deterministic)
        assert layer.w13_weight.dim() == (5 if split else 4)
        assert layer.w2_weight.dim() == (5 if split and inter % 32 == 0 else 4)
        assert layer.gate.weight.dim() == 2  # 8 outputs: the router's weight keeps the transposed layout
        with torch.inference_mode():
            out = layer(x)
        assert split_error(out, expected) < (SPLIT_TOL_FEW_ROWS if split else 1e-5), (precision, deterministic)
