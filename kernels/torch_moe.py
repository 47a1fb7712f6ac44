"""Mixture-of-experts in plain torch, on any device: the router's expert choice and the experts'
compute grouped by expert (the fallback where no compiled or Triton kernel runs, and the reference
the kernels are tested against).

- ``select_experts``: softmax over every expert's logit in float32, the top k, renormalised over the
  chosen where the model does so (Mixtral always; Qwen3-MoE with ``norm_topk_prob``), as transformers
  computes it.
- ``moe_experts``: the (token, slot) pairs sorted by expert (stable: tokens in order within an
  expert), one product per expert for gate|up, activation-and-multiply, one for down, each pair's
  output weighted in float32 and a token's slots summed in slot order. A loop over experts, not over
  tokens. Pairs routed to experts outside ``[expert_start, expert_start + E)`` (another rank's, under
  expert parallelism) add nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids int64 [T, k]) from router logits [T, E]."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def sort_by_expert(topk_ids: torch.Tensor, expert_start: int, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """(the local pairs' flat indices t * k + s sorted by expert, tokens in order within one; rows per
    expert)."""
    flat = topk_ids.reshape(-1) - expert_start
    local = (flat >= 0) & (flat < num_experts)
    key = torch.where(local, flat, num_experts)
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts].tolist()
    return order[: sum(counts)], counts


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, expert_start: int = 0,
                act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; topk_weights [T, k];
    topk_ids [T, k] -> [T, H] in x's dtype."""
    t, h = x.shape
    k = topk_ids.shape[1]
    num_experts, inter = w13.shape[0], w2.shape[2]
    pairs, counts = sort_by_expert(topk_ids, expert_start, num_experts)
    rows = x[pairs // k]
    ys = torch.empty(len(pairs), h, dtype=torch.float32, device=x.device)
    start = 0
    for e, m in enumerate(counts):
        if m:
            gate_up = F.linear(rows[start:start + m], w13[e])
            ys[start:start + m] = F.linear(act(gate_up[:, :inter]) * gate_up[:, inter:], w2[e]).float()
        start += m
    slots = torch.zeros(t * k, h, dtype=torch.float32, device=x.device)
    slots[pairs] = ys * topk_weights.reshape(-1)[pairs, None].float()
    out = slots.view(t, k, h)[:, 0].clone()
    for s in range(1, k):  # slot order, as the compiled op adds them
        out += slots.view(t, k, h)[:, s]
    return out.to(x.dtype)
