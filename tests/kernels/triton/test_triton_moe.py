"""The Triton fused-MoE kernel under the interpreter: the block-aligned sort of pairs per expert, the
grouped GEMM against a per-token float64 reference (float32 and float16, expert-parallel ranges, odd
widths), a Mixtral-shaped ``FusedMoE`` layer bound to the Triton backend's ops against the same layer
on plain torch, and the whole Mixtral engine on the Triton path against Hugging Face."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from kernels.torch_moe import select_experts
from kernels.triton import TritonAttentionBackend
from kernels.triton.moe import BLOCK_M, align_by_expert, fused_moe, max_blocks
from tests.e2e.prompts import test_prompts as make_prompts
from tests.e2e.test_moe_vs_hf import moe_dirs, moe_oracle  # noqa: F401 (fixtures)
from tests.kernels.test_cpu_moe import problem, reference
from workers.layers.kernels import bind_layer_ops
from workers.layers.moe import FusedMoE
from workers.parallel_state import TPGroup
from workers.weight_loader import TensorSlice


@pytest.mark.parametrize("expert_start,num_local", [(0, 8), (3, 3)])
def test_pairs_sorted_per_expert_in_aligned_blocks(expert_start, num_local):
    ids = torch.randint(0, 8, (29, 2), generator=torch.Generator().manual_seed(1))
    sorted_ids, block_expert, num_post = align_by_expert(ids, expert_start, num_local)
    n = ids.numel()
    assert sorted_ids.shape == (max_blocks(n, num_local) * BLOCK_M,) and block_expert.shape == (sorted_ids.shape[0] // BLOCK_M,)
    flat = ids.reshape(-1) - expert_start
    local = [p for p in range(n) if 0 <= flat[p] < num_local]
    total = int(num_post[0])
    assert total % BLOCK_M == 0 and sorted_ids[total:].eq(n).all()
    seen = []
    for b in range(total // BLOCK_M):
        block = [int(p) for p in sorted_ids[b * BLOCK_M:(b + 1) * BLOCK_M] if p < n]
        assert all(flat[p] == block_expert[b] for p in block)
        seen += block
    # every local pair once, by expert, in token order within an expert
    assert seen == sorted(local, key=lambda p: (int(flat[p]), p))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-2)])
@pytest.mark.parametrize("shape", [(64, 48, 8, 2), (200, 68, 6, 2), (33, 7, 3, 3)], ids=lambda s: "x".join(map(str, s)))
def test_fused_moe_matches_the_reference(shape, dtype, tol):
    hidden, inter, experts, top_k = shape
    for tokens in (1, 21):
        x, w13, w2, weights, ids = problem(tokens, hidden, inter, experts, top_k, seed=tokens)
        x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
        expected = reference(x, w13, w2, weights, ids)
        got = fused_moe(x, w13, w2, weights, ids)
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)
        # two expert-parallel ranks' halves sum to the whole
        half = experts // 2
        parts = [fused_moe(x, w13[s:s + n], w2[s:s + n], weights, ids, s)
                 for s, n in ((0, half), (half, experts - half))]
        torch.testing.assert_close((parts[0].double() + parts[1].double()), expected, rtol=tol, atol=tol)


def test_deterministic_rows_do_not_depend_on_the_batch():
    x, w13, w2, weights, ids = problem(40, 64, 48, 8, 2, seed=9)
    whole = fused_moe(x, w13, w2, weights, ids, deterministic=True)
    for t in (0, 39):
        alone = fused_moe(x[t:t + 1], w13, w2, weights[t:t + 1], ids[t:t + 1], deterministic=True)
        assert torch.equal(alone[0], whole[t])


def test_a_layer_bound_to_the_triton_ops_matches_plain_torch():
    """A Mixtral-shaped layer (8 experts, top 2, renormalised), loaded from per-expert tensors, on
    the Triton backend's ops and on plain torch."""
    torch.manual_seed(0)
    hidden, inter, experts = 64, 48, 8
    layers = []
    weights = {"gate": torch.randn(experts, hidden) * hidden ** -0.5,
               **{(e, p): torch.randn(inter, hidden) * hidden ** -0.5 for e in range(experts) for p in (0, 1)},
               **{(e, 2): torch.randn(hidden, inter) * inter ** -0.5 for e in range(experts)}}
    for _ in range(2):
        layer = FusedMoE(experts, 2, hidden, inter, True, "silu", TPGroup(), torch.float32, torch.device("cpu"))
        layer.gate.weight.data.copy_(weights["gate"])
        for (e, p), w in ((k, v) for k, v in weights.items() if k != "gate"):
            param = layer.w2_weight if p == 2 else layer.w13_weight
            param.weight_loader(param, TensorSlice(w), (e, p))
        layers.append(layer)
    bind_layer_ops(layers[0], TritonAttentionBackend.fused_ops)
    assert layers[0].ops is TritonAttentionBackend.fused_ops and layers[1].ops is None
    x = torch.randn(19, hidden)
    torch.testing.assert_close(layers[0](x), layers[1](x), rtol=1e-5, atol=1e-5)
    weights_k, ids = select_experts(x @ weights["gate"].t(), 2, renormalize=True)
    assert len(ids.unique()) > 4  # most experts see tokens
    torch.testing.assert_close(weights_k.sum(-1), torch.ones(19))
    ref = reference(x, layers[1].w13_weight.data, layers[1].w2_weight.data, weights_k, ids)
    torch.testing.assert_close(layers[1](x).double(), ref, rtol=1e-5, atol=1e-5)


def test_mixtral_matches_hf_on_the_triton_path(moe_dirs, moe_oracle):  # noqa: F811
    """The whole engine with the fused MoE, attention and layer ops as Triton kernels (interpreted):
    chunked prefill (16-token budget), a prefix-cache hit, decodes; teacher forcing against HF."""
    prompts = make_prompts(moe_dirs["mixtral"])
    shared = prompts[3][:23]
    chosen = [prompts[1], shared + prompts[2][:9], shared + prompts[0] + prompts[1][:4]]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with LLM(model=moe_dirs["mixtral"], attention_backend="triton", block_size=5, num_kv_blocks=48, max_model_len=96,
             max_num_batched_tokens=16) as llm:
        moe = [m for m in llm.core.executor.worker.runner.model.modules() if isinstance(m, FusedMoE)]
        assert moe and all(m.ops is TritonAttentionBackend.fused_ops for m in moe)
        first = llm.generate([{"prompt_token_ids": p} for p in chosen[:2]], params)
        second = llm.generate([{"prompt_token_ids": chosen[2]}], params)
    for prompt, out in zip(chosen, first + second):
        moe_oracle("mixtral").assert_greedy(prompt, out.outputs[0].token_ids)
    assert second[0].num_cached_tokens == 20


def test_the_warm_up_compiles_every_fused_moe_variant_a_run_launches(moe_dirs):  # noqa: F811
    """Decodes and prefill chunks, the CUDA-graph buckets' buffers (run eagerly), inputs staged as on
    CUDA: every fused-MoE launch is of a variant the 16-token warm-up forward launched."""
    from tests.kernels.triton.test_triton_warmup import _describe, _run

    warm, used, _, _ = _run(moe_dirs["mixtral"], False, True)
    missing = [used[key] for key in used.keys() - warm.keys()]
    assert not missing, "\n".join(_describe(missing))
    moe = {launch.constexprs["MUL_ROUTED_WEIGHT"] for launch in used.values() if launch.name == "_fused_moe_kernel"}
    assert moe == {False, True}  # gate|up and down
