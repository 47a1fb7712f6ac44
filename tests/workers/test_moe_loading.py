"""Each rank of a mixture-of-experts layer reads only its part of the checkpoint's per-expert tensors:
under tensor parallelism its slice of every expert's intermediate features, under expert parallelism
its own experts whole (split as evenly as they go) and nothing of the others; a missing expert is a
clear error; checkpoint names route to the fused parameters."""

from __future__ import annotations

import pytest
import torch

from workers.layers.moe import FusedMoE, expert_partition, expert_route
from workers.parallel_state import TPGroup
from workers.weight_loader import load_into

HIDDEN, INTER = 16, 8


class Recording:
    """A lazily read checkpoint tensor that records what is read of it."""

    def __init__(self, tensor: torch.Tensor, log: list, name: str) -> None:
        self.tensor, self.log, self.name = tensor, log, name

    def __getitem__(self, index):
        self.log.append((self.name, index))
        return self.tensor[index]

    def get_shape(self):
        return list(self.tensor.shape)


def checkpoint(num_experts: int, log: list, style: str = "mixtral"):
    names = ("w1", "w3", "w2") if style == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    g = torch.Generator().manual_seed(0)
    tensors = {"moe.gate.weight": torch.randn(num_experts, HIDDEN, generator=g)}
    for e in range(num_experts):
        tensors[f"moe.experts.{e}.{names[0]}.weight"] = torch.randn(INTER, HIDDEN, generator=g)
        tensors[f"moe.experts.{e}.{names[1]}.weight"] = torch.randn(INTER, HIDDEN, generator=g)
        tensors[f"moe.experts.{e}.{names[2]}.weight"] = torch.randn(HIDDEN, INTER, generator=g)
    return tensors, [(name, Recording(t, log, name)) for name, t in tensors.items()]


class Holder(torch.nn.Module):
    def __init__(self, num_experts: int, tp: TPGroup, expert_parallel: bool) -> None:
        super().__init__()
        self.moe = FusedMoE(num_experts, 2, HIDDEN, INTER, True, "silu", tp, torch.float32, torch.device("cpu"),
                            expert_parallel)


@pytest.mark.parametrize("style", ["mixtral", "qwen3_moe"])
def test_expert_parallel_ranks_read_only_their_experts(style):
    for rank, (start, count) in enumerate([(0, 2), (2, 3)]):  # 5 experts over 2 ranks
        log: list = []
        tensors, weights = checkpoint(5, log, style)
        holder = Holder(5, TPGroup(rank, 2), expert_parallel=True)
        load_into(holder, weights, route=expert_route)
        moe = holder.moe
        assert (moe.expert_start, moe.num_local_experts, moe.intermediate) == (start, count, INTER)
        read_experts = {int(name.split(".")[2]) for name, _ in log if ".experts." in name}
        assert read_experts == set(range(start, start + count))
        names = [n for n in tensors if ".experts." in n]
        for local, e in enumerate(range(start, start + count)):
            gate, up, down = (tensors[n] for n in names[3 * e:3 * e + 3])
            assert torch.equal(moe.w13_weight[local], torch.cat([gate, up]))
            assert torch.equal(moe.w2_weight[local], down)


def test_tensor_parallel_ranks_read_their_slice_of_every_expert():
    for rank in (0, 1):
        log: list = []
        tensors, weights = checkpoint(3, log)
        holder = Holder(3, TPGroup(rank, 2), expert_parallel=False)
        load_into(holder, weights, route=expert_route)
        half = slice(rank * INTER // 2, (rank + 1) * INTER // 2)
        for e in range(3):
            w1, w3, w2 = (tensors[f"moe.experts.{e}.{n}.weight"] for n in ("w1", "w3", "w2"))
            assert torch.equal(holder.moe.w13_weight[e], torch.cat([w1[half], w3[half]]))
            assert torch.equal(holder.moe.w2_weight[e], w2[:, half])
        reads = [index for name, index in log if name.endswith("w1.weight")]
        assert reads == [slice(half.start, half.stop)] * 3  # the rows of this rank only, never the whole tensor


def test_a_missing_expert_is_named():
    _, weights = checkpoint(4, [])
    weights = [(n, w) for n, w in weights if not n.startswith("moe.experts.3.w3")]
    with pytest.raises(ValueError, match=r"missing parameters: moe.w13_weight\[\(3, 1\)\]"):
        load_into(Holder(4, TPGroup(1, 2), expert_parallel=True), weights, route=expert_route)


def test_routing_and_partition():
    assert expert_route("model.layers.3.block_sparse_moe.experts.7.w2.weight") == (
        "model.layers.3.block_sparse_moe.w2_weight", (7, 2))
    assert expert_route("model.layers.0.mlp.experts.12.up_proj.weight") == ("model.layers.0.mlp.w13_weight", (12, 1))
    assert expert_route("model.layers.0.mlp.gate_proj.weight") is None  # a dense layer's MLP
    assert expert_route("model.layers.0.mlp.gate.weight") is None  # the router
    assert [expert_partition(10, TPGroup(r, 4), True) for r in range(4)] == [(0, 2), (2, 3), (5, 2), (7, 3)]
    assert expert_partition(10, TPGroup(1, 4), False) == (0, 10)
    with pytest.raises(ValueError, match="3 experts cannot cover 4 ranks"):
        expert_partition(3, TPGroup(0, 4), True)
