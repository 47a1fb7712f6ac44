"""The fused mixture-of-experts of the Triton backend, after vLLM's ``fused_moe``: a grouped GEMM over
the (token, slot) pairs sorted by expert.

``align_by_expert`` sorts the pairs routed to this rank's experts by expert (stable: tokens in order
within an expert) and pads each expert's run to a multiple of ``BLOCK_M`` with a sentinel id, so that
every block of ``BLOCK_M`` sorted ids belongs to one expert (``block_expert``); the blocks past the
padded total (``num_post_padded``, on the device: no host synchronisation, so CUDA graphs can hold
it) exit at once. The grid is sized for the most blocks any routing can need.

Two launches of ``_fused_moe_kernel``: gate|up (A rows: each pair's token, ``x``), SiLU-and-multiply
(``ops.silu_and_mul``), then down (A rows: each pair's own row), whose output rows are multiplied by
the pair's routing weight in float32. A program computes a ``BLOCK_M x BLOCK_N`` tile of one expert:
each output element one chain of ``BLOCK_K``-wide partial products in order along K, no split of K,
so a row's result does not depend on the rows beside it (compiled, the partial products are
``tl.dot``s; under the interpreter in deterministic mode, multiplies summed, as in
``kernels.triton.linear``). A token's slots are summed in slot order in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.ops import INTERPRETED, _launch, silu_and_mul

# compiled: tiles for decode-sized expert batches; the interpreter (tests on CPU) takes wider N and K
# tiles: fewer programs, each run op by op in Python
BLOCK_M, BLOCK_N, BLOCK_K = (16, 256, 128) if INTERPRETED else (16, 64, 32)


@triton.jit(do_not_specialize=["num_valid"])  # the pairs of a step change from step to step
def _fused_moe_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr, num_post_padded_ptr,
    N, K, num_valid, top_k,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    A_PER_PAIR: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = pairs < num_valid
    if A_PER_PAIR:
        a_rows = pairs
    else:
        a_rows = pairs // top_k
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    cols64 = cols.to(tl.int64)
    inner = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + inner
        k_ok = k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + expert * stride_be + cols64[None, :] * stride_bn + k[:, None] * stride_bk,
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if USE_DOT:
            acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        else:  # the interpreter's tl.dot is a BLAS call whose rows depend on where they sit in the tile
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    tl.store(c_ptr + pairs[:, None] * stride_cm + cols64[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def max_blocks(num_pairs: int, num_experts: int, block_m: int = BLOCK_M) -> int:
    """The most blocks of ``block_m`` sorted ids any routing of ``num_pairs`` pairs over
    ``num_experts`` experts pads to."""
    return triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m)


def align_by_expert(topk_ids: torch.Tensor, expert_start: int, num_experts: int,
                    block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted pair ids [max_blocks x block_m] int32, sentinel T*k past each expert's run; the expert
    of each block int32; the padded total int32 [1]), computed on the ids' device without a host
    synchronisation."""
    flat = topk_ids.reshape(-1) - expert_start
    n, device = flat.numel(), flat.device
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    order = torch.argsort(key, stable=True)
    # not bincount: on CUDA it reads the largest id back to the host (no capture in a CUDA graph)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts] = 0  # other ranks' pairs take no rows
    padded_end = torch.cumsum(padded, 0)
    run_start = torch.cumsum(counts, 0) - counts
    sorted_key = key[order]
    dest = padded_end[sorted_key] - padded[sorted_key] + torch.arange(n, device=device) - run_start[sorted_key]
    blocks = max_blocks(n, num_experts, block_m)
    rows = blocks * block_m
    dest = torch.where(sorted_key < num_experts, dest, rows)  # other ranks' pairs: a row thrown away
    sorted_ids = torch.full((rows + 1,), n, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    starts = torch.arange(blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end[:num_experts], starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids[:rows], block_expert.to(torch.int32), padded_end[num_experts - 1:num_experts].to(torch.int32)


def moe_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, weights: torch.Tensor, sorted_ids: torch.Tensor,
             block_expert: torch.Tensor, num_post_padded: torch.Tensor, num_valid: int, top_k: int,
             a_per_pair: bool, mul_routed_weight: bool, deterministic: bool = False) -> None:
    """c[pair] = a[pair or pair // top_k] . b[expert]^T (x the pair's weight) for every sorted pair."""
    n, k = b.shape[1], b.shape[2]
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    grid = (sorted_ids.shape[0] // BLOCK_M, triton.cdiv(n, BLOCK_N))
    _launch(_fused_moe_kernel, grid, (
        a, b, c, weights, sorted_ids, block_expert, num_post_padded, n, k, num_valid, top_k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
    ), dict(A_PER_PAIR=a_per_pair, MUL_ROUTED_WEIGHT=mul_routed_weight, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K, DOT_PRECISION=precision, USE_DOT=not (deterministic and INTERPRETED)))


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, expert_start: int = 0, deterministic: bool = False) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; topk_weights [T, k];
    topk_ids [T, k] (pairs outside ``[expert_start, expert_start + E)`` add nothing) -> [T, H]."""
    t, h = x.shape
    top_k = topk_ids.shape[1]
    num_experts = w13.shape[0]
    if w13.shape[2] != h or w2.shape[1] != h or w13.shape[1] != 2 * w2.shape[2]:
        raise ValueError(f"fused_moe: x [.., {h}] against w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)}")
    sorted_ids, block_expert, num_post = align_by_expert(topk_ids, expert_start, num_experts)
    pairs = t * top_k
    gate_up = torch.zeros(pairs, w13.shape[1], dtype=x.dtype, device=x.device)  # other ranks' rows stay 0
    x = x if x.stride(-1) == 1 else x.contiguous()
    moe_gemm(x, w13, gate_up, topk_weights, sorted_ids, block_expert, num_post, pairs, top_k, False, False,
             deterministic)
    act = silu_and_mul(gate_up)
    slots = torch.zeros(pairs, h, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    moe_gemm(act, w2, slots, weights, sorted_ids, block_expert, num_post, pairs, top_k, True, True, deterministic)
    slots = slots.view(t, top_k, h)
    out = slots[:, 0].clone()
    for s in range(1, top_k):  # slot order
        out += slots[:, s]
    return out.to(x.dtype)

