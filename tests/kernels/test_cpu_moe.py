"""The compiled mixture-of-experts op (``moe.cpp``) and the plain-torch one (``kernels.torch_moe``)
against a per-token float64 reference, at 1, 2, 3, 4 and 8 threads and at widths that are no
multiple of the panel width; the compiled op's rows do not depend on the batch (bitwise); pairs
routed to other ranks' experts add nothing; the router as transformers computes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.torch_moe import moe_experts, select_experts
from tests.compiled import cpu_backend_or_skip
from tests.kernels.test_cpu_envelope import threads

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
