"""Tensor-parallel linear layers; every parameter carries a ``weight_loader`` that reads its rank's part.

With ``W`` the checkpoint's ``[out, in]`` weight and tp ranks::

    ColumnParallelLinear   rank r holds rows    W[r*out/tp : (r+1)*out/tp]   -> output shard, no gather
    RowParallelLinear      rank r holds columns W[:, r*in/tp : (r+1)*in/tp]  -> partial sums, all-reduce, + b
    MergedColumnParallel   rank r holds rows    [gate_r | up_r]              one matmul, shard ids 0, 1
    QKVParallelLinear      rank r holds rows    [q_r | k_r | v_r]            one matmul, shard ids "q" "k" "v"

A column-parallel layer feeds a row-parallel one directly (attention heads, MLP features), so a
transformer block needs one all-reduce per row-parallel layer and no gather.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from workers.parallel_state import TPGroup
from workers.weight_loader import ShardId, WeakLoader, WeightSlice, copy_weight, default_weight_loader

Loader = Callable[[nn.Parameter, WeightSlice, ShardId], None]


def new_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, loader: Loader) -> nn.Parameter:
    """An uninitialised inference parameter loaded by ``loader`` (a layer's own method held weakly:
    ``WeakLoader``, no reference cycle)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = WeakLoader(loader) if inspect.ismethod(loader) else loader
    return param


def kv_head_partition(num_kv_heads: int, tp: TPGroup) -> tuple[int, int]:
    """(first KV head, KV heads) held by this rank.

    KV heads are split across ranks; when tp > num_kv_heads each head is replicated on
    tp // num_kv_heads consecutive ranks and rank r holds head r // (tp // num_kv_heads).
    """
    if tp.size <= num_kv_heads:
        start, end = tp.shard(num_kv_heads, "KV heads")
        return start, end - start
    if tp.size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over {tp.size} ranks")
    return tp.rank // (tp.size // num_kv_heads), 1


class ReplicatedLinear(nn.Module):
    """The full ``W [out, in]`` on every rank: [T, in] -> [T, out]."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.weight = new_param((output_size, input_size), dtype, device, default_weight_loader)
        self.bias = new_param((output_size,), dtype, device, default_weight_loader) if bias else None
        self.linear = F.linear  # or the compiled CPU linear (``workers.layers.kernels``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.weight, self.bias)


class _ColumnShards(nn.Module):
    """Column-parallel base: this rank's output rows concatenate one slice of each named checkpoint
    tensor. ``shards`` maps shard id -> (first row in the checkpoint tensor, rows on this rank), in
    output order. [T, in] -> [T, sum of rows]."""

    def __init__(
        self,
        input_size: int,
        shards: dict[ShardId, tuple[int, int]],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.shard_layout: dict[ShardId, tuple[int, int, int]] = {}  # id -> (row here, row in src, rows)
        offset = 0
        for shard_id, (src_start, rows) in shards.items():
            self.shard_layout[shard_id] = (offset, src_start, rows)
            offset += rows
        self.output_size_per_rank = offset
        self.weight = new_param((offset, input_size), dtype, device, self.weight_loader)
        self.bias = new_param((offset,), dtype, device, self.weight_loader) if bias else None
        self.linear = F.linear  # or the compiled CPU linear (``workers.layers.kernels``)

    def weight_loader(self, param: nn.Parameter, weight: WeightSlice, shard_id: ShardId = None) -> None:
        if shard_id not in self.shard_layout:
            raise ValueError(f"unknown shard {shard_id!r}; this layer takes {list(self.shard_layout)}")
        offset, src_start, rows = self.shard_layout[shard_id]
        copy_weight(param.data[offset : offset + rows], weight[src_start : src_start + rows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.weight, self.bias)


class ColumnParallelLinear(_ColumnShards):
    """Output features split across ranks: [T, in] -> [T, out / tp] (this rank's shard, not gathered)."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        start, end = tp.shard(output_size, "output features")
        super().__init__(input_size, {None: (start, end - start)}, bias, dtype, device)


class MergedColumnParallelLinear(_ColumnShards):
    """Several column-parallel layers on one input fused into one matmul (gate|up): each output is
    split across ranks and this rank's pieces are concatenated. Shard ids 0, 1, ...
    [T, in] -> [T, sum(output_sizes) / tp]."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shards: dict[ShardId, tuple[int, int]] = {}
        for i, size in enumerate(output_sizes):
            start, end = tp.shard(size, "output features")
            shards[i] = (start, end - start)
        super().__init__(input_size, shards, bias, dtype, device)


class QKVParallelLinear(_ColumnShards):
    """Fused q|k|v projection of this rank's heads: [T, hidden] -> [T, (heads + 2 * kv_heads) * head_dim]
    per rank. Query heads are split across ranks; KV heads are split too, or replicated when
    tp > num_kv_heads (see ``kv_head_partition``). Shard ids "q", "k", "v"."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        q_start, q_end = tp.shard(num_heads, "attention heads")
        kv_start, self.num_kv_heads_per_rank = kv_head_partition(num_kv_heads, tp)
        self.num_heads_per_rank = q_end - q_start
        kv_rows = (kv_start * head_dim, self.num_kv_heads_per_rank * head_dim)
        shards = {"q": (q_start * head_dim, self.num_heads_per_rank * head_dim), "k": kv_rows, "v": kv_rows}
        super().__init__(hidden_size, shards, bias, dtype, device)


class RowParallelLinear(nn.Module):
    """Input features split across ranks: [T, in / tp] (a column-parallel output) -> [T, out], the
    partial products all-reduced and the bias added once after the reduce."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_start, input_end = tp.shard(input_size, "input features")
        self.weight = new_param((output_size, input_end - self.input_start), dtype, device, self.weight_loader)
        self.bias = new_param((output_size,), dtype, device, default_weight_loader) if bias else None
        self.linear = F.linear  # or the compiled CPU linear (``workers.layers.kernels``)

    def weight_loader(self, param: nn.Parameter, weight: WeightSlice, shard_id: ShardId = None) -> None:
        copy_weight(param.data, weight[:, self.input_start : self.input_start + param.shape[1]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.linear(x, self.weight, self.bias)
        out = self.tp.all_reduce(self.linear(x, self.weight, None))
        return out if self.bias is None else out.add_(self.bias)
