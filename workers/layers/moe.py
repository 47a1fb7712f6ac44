"""A sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE) of one tensor-parallel rank.

The router (``gate``, replicated) scores every expert; ``select_experts`` picks each token's top k
in float32 (``kernels.torch_moe``); the experts run grouped by expert: the compiled CPU op
(``moe.cpp``, weights packed once in column panels, or under ``cpu_matmul_precision="high"`` split
for the bf16x3 product on AMX tiles), the Triton fused-MoE kernel (``fused_ops``), or
plain torch. The rank's partial output is summed over the group by the all-reduce every row-parallel
layer uses.

How the experts are split across ranks:

- tensor parallelism (the default): every rank holds every expert, a slice of its intermediate
  features (gate|up rows, down columns), as a dense MLP is split;
- ``expert_parallel`` (vLLM's ``enable_expert_parallel``): each rank holds whole experts, a
  contiguous range of them split as evenly as they go (``expert_partition``), and computes only the
  pairs routed to them; the other ranks' pairs add nothing here.

Each rank's loader reads only its own slices (or only its own experts) from the checkpoint's
per-expert tensors (``experts.{e}.w1/w3/w2`` or ``experts.{e}.gate_proj/up_proj/down_proj``,
``expert_route``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.cpu.layer_ops import lay_out_expert_weight
from kernels.torch_moe import moe_experts, select_experts
from workers.layers.activation import activation
from workers.layers.linear import ReplicatedLinear, new_param
from workers.parallel_state import TPGroup
from workers.weight_loader import ShardId, WeightSlice, copy_weight

# a checkpoint's per-expert tensor name -> (the fused parameter, which part: 0 gate, 1 up, 2 down)
_EXPERT_NAME = re.compile(r"^(.*)\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")
_PART = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1, "w2": 2, "down_proj": 2}


def expert_route(name: str) -> tuple[str, ShardId] | None:
    """(parameter name, (expert, part)) of a per-expert checkpoint tensor, else None (``load_into``'s
    ``route``)."""
    match = _EXPERT_NAME.match(name)
    if match is None:
        return None
    prefix, expert, part = match.group(1), int(match.group(2)), _PART[match.group(3)]
    return f"{prefix}.{'w2_weight' if part == 2 else 'w13_weight'}", (expert, part)


def expert_partition(num_experts: int, tp: TPGroup, expert_parallel: bool) -> tuple[int, int]:
    """(first expert, experts) held by this rank: all of them, or under ``expert_parallel`` a
    contiguous range: rank r holds experts [E r // tp, E (r + 1) // tp), so the counts differ by at most
    one and, where tp does not divide E, the extra ones do not go to the first ranks (5 experts over 2
    ranks: 2, then 3; 10 over 4: 2, 3, 2, 3)."""
    if not expert_parallel:
        return 0, num_experts
    if num_experts < tp.size:
        raise ValueError(f"enable_expert_parallel places whole experts on ranks: {num_experts} experts cannot "
                         f"cover {tp.size} ranks")
    start, end = num_experts * tp.rank // tp.size, num_experts * (tp.rank + 1) // tp.size
    return start, end - start


class FusedMoE(nn.Module):
    """[T, hidden] -> [T, hidden], summed over the tensor-parallel group.

    ``w13_weight`` [local experts, 2 x intermediate on this rank, hidden] (gate rows, then up rows)
    and ``w2_weight`` [local experts, hidden, intermediate on this rank], as loaded; on the compiled
    CPU path they are re-laid out in column panels, or split for the bf16x3 product (``pack_for_cpu``)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 hidden_act: str, tp: TPGroup, dtype: torch.dtype, device: torch.device,
                 expert_parallel: bool = False) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be between 1 and the {num_experts} experts, not {top_k}")
        self.tp, self.top_k, self.renormalize, self.num_experts = tp, top_k, renormalize, num_experts
        self.hidden_size = hidden_size
        self.expert_start, self.num_local_experts = expert_partition(num_experts, tp, expert_parallel)
        if expert_parallel:
            self.inter_start, self.intermediate = 0, intermediate_size
        else:
            self.inter_start, end = tp.shard(intermediate_size, "expert intermediate features")
            self.intermediate = end - self.inter_start
        self.act: Callable[[torch.Tensor], torch.Tensor] = activation(hidden_act)
        self.gate = ReplicatedLinear(hidden_size, num_experts, False, dtype, device)  # the router
        e, i = self.num_local_experts, self.intermediate
        self.w13_weight = new_param((e, 2 * i, hidden_size), dtype, device, self.weight_loader)
        self.w2_weight = new_param((e, hidden_size, i), dtype, device, self.weight_loader)
        local = range(self.expert_start, self.expert_start + e)
        self.w13_weight.shard_ids = {(x, part) for x in local for part in (0, 1)}
        self.w2_weight.shard_ids = {(x, 2) for x in local}
        self.ops = None  # layer ops: the Triton backend's ``fused_moe`` where it has one
        self.cpu_experts = None  # the compiled op, once the weights are packed (``pack_for_cpu``)
        self.deterministic = False  # set by the binding: the Triton kernel then multiplies without tl.dot interpreted

    def weight_loader(self, param: nn.Parameter, weight: WeightSlice, shard_id: ShardId = None) -> None:
        if not isinstance(shard_id, tuple) or len(shard_id) != 2:
            raise ValueError(f"expert weights are loaded per (expert, part), not {shard_id!r}")
        expert, part = shard_id
        local = expert - self.expert_start
        if not 0 <= local < self.num_local_experts:
            if not 0 <= expert < self.num_experts:
                raise ValueError(f"expert {expert} is outside the model's {self.num_experts}")
            return  # another rank's expert: nothing is read
        i, start = self.intermediate, self.inter_start
        if part == 2:
            copy_weight(param.data[local], weight[:, start:start + i])
        else:
            copy_weight(param.data[local, part * i:(part + 1) * i], weight[start:start + i])

    def pack_for_cpu(self, layer_ops, split: bool = False) -> bool:
        """Lay the expert weights out for the compiled op (float32, SiLU experts; others keep plain torch):
        in padded column panels for the float32 product, or with ``split`` (``bind_cpu_kernels``' "split"
        layout: ``cpu_matmul_precision="high"`` where the CPU grants AMX tiles) split into bfloat16 hi and
        lo halves for the bf16x3 product, each of w13 and w2 whose input features (hidden, intermediate)
        32 divides; the other stays in panels. Returns whether any was split."""
        if self.w13_weight.dtype != torch.float32 or self.act is not F.silu:
            return False
        split_any = False
        for param in (self.w13_weight, self.w2_weight):
            param.data, was_split = lay_out_expert_weight(layer_ops, param.data, split)
            split_any |= was_split
        self.cpu_experts = layer_ops.moe_experts
        return split_any

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        fused = getattr(self.ops, "fused_moe", None)
        if self.cpu_experts is not None:
            out = self.cpu_experts(x, self.w13_weight, self.w2_weight, weights, ids, self.expert_start,
                                   self.intermediate)
        elif fused is not None and self.act is F.silu:
            out = fused(x, self.w13_weight, self.w2_weight, weights, ids, self.expert_start,
                        deterministic=self.deterministic)
        else:
            out = moe_experts(x, self.w13_weight, self.w2_weight, weights, ids, self.expert_start, self.act)
        return self.tp.all_reduce(out)
