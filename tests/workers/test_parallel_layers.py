"""Each parallel layer sharded over simulated ranks (threads, see conftest.py) against the unsharded
computation with the same full weights, and the rotary cache against transformers' for each rope type."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from workers.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    rope_parameters,
)
from workers.parallel_state import TPGroup
from workers.weight_loader import ShardId, TensorSlice

CPU, F32 = torch.device("cpu"), torch.float32
RunRanks = Callable[[int, Callable[[TPGroup], object]], list]
_gen = torch.Generator().manual_seed(0)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen)


def load(layer: nn.Module, *weights: tuple[str, torch.Tensor, ShardId]) -> nn.Module:
    params = dict(layer.named_parameters())
    for name, tensor, shard_id in weights:
        params[name].weight_loader(params[name], TensorSlice(tensor), shard_id)
    return layer


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_column_parallel_outputs_concatenate(tp_size: int, tp_ranks: RunRanks) -> None:
    w, b, x = randn(96, 32), randn(96), randn(5, 32)
    outs = tp_ranks(tp_size, lambda tp: load(
        ColumnParallelLinear(32, 96, True, tp, F32, CPU), ("weight", w, None), ("bias", b, None))(x))
    assert all(out.shape == (5, 96 // tp_size) for out in outs)
    torch.testing.assert_close(torch.cat(outs, -1), F.linear(x, w, b))


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_row_parallel_reduces_and_adds_bias_once(tp_size: int, tp_ranks: RunRanks) -> None:
    w, b, x = randn(32, 96), randn(32), randn(5, 96)

    def rank(tp: TPGroup) -> torch.Tensor:
        layer = load(RowParallelLinear(96, 32, True, tp, F32, CPU), ("weight", w, None), ("bias", b, None))
        start, end = tp.shard(96)
        return layer(x[:, start:end])

    for out in tp_ranks(tp_size, rank):  # every rank holds the full, reduced output
        torch.testing.assert_close(out, F.linear(x, w, b))


def test_merged_column_parallel_holds_gate_and_up_shards(tp_ranks: RunRanks) -> None:
    gate, up, x = randn(64, 32), randn(64, 32), randn(5, 32)
    outs = tp_ranks(2, lambda tp: load(
        MergedColumnParallelLinear(32, [64, 64], False, tp, F32, CPU), ("weight", gate, 0), ("weight", up, 1))(x))
    # rank r: [gate rows of r | up rows of r]
    torch.testing.assert_close(torch.cat([out[:, :32] for out in outs], -1), x @ gate.T)
    torch.testing.assert_close(torch.cat([out[:, 32:] for out in outs], -1), x @ up.T)


@pytest.mark.parametrize(
    "tp_size,num_heads,num_kv_heads",
    [(1, 4, 2), (2, 4, 2), (2, 8, 4), (4, 4, 2), (4, 8, 1)],  # the last two replicate KV heads
)
def test_qkv_parallel_heads(tp_size: int, num_heads: int, num_kv_heads: int, tp_ranks: RunRanks) -> None:
    d, hidden = 8, 32
    wq, wk, wv = randn(num_heads * d, hidden), randn(num_kv_heads * d, hidden), randn(num_kv_heads * d, hidden)
    bq, bk, bv = randn(num_heads * d), randn(num_kv_heads * d), randn(num_kv_heads * d)
    x = randn(5, hidden)
    q_ref, k_ref, v_ref = F.linear(x, wq, bq), F.linear(x, wk, bk), F.linear(x, wv, bv)

    def rank(tp: TPGroup) -> tuple[int, int, torch.Tensor]:
        layer = QKVParallelLinear(hidden, d, num_heads, num_kv_heads, True, tp, F32, CPU)
        load(layer, *[(p, t, s) for s, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv))
                      for p, t in (("weight", w), ("bias", b))])
        return layer.num_heads_per_rank, layer.num_kv_heads_per_rank, layer(x)

    heads, kv_heads = num_heads // tp_size, max(1, num_kv_heads // tp_size)
    for r, (heads_r, kv_heads_r, out) in enumerate(tp_ranks(tp_size, rank)):
        assert (heads_r, kv_heads_r) == (heads, kv_heads)
        kv_head = r * kv_heads if tp_size <= num_kv_heads else r // (tp_size // num_kv_heads)
        q, k, v = out.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        kv_cols = slice(kv_head * d, (kv_head + kv_heads) * d)
        torch.testing.assert_close(q, q_ref[:, r * heads * d : (r + 1) * heads * d])
        torch.testing.assert_close(k, k_ref[:, kv_cols])
        torch.testing.assert_close(v, v_ref[:, kv_cols])


def test_uneven_head_splits_are_rejected() -> None:
    with pytest.raises(ValueError, match="attention heads of 4 does not split across 3"):
        QKVParallelLinear(32, 8, 4, 4, False, TPGroup(0, 3), F32, CPU)
    with pytest.raises(ValueError, match="4 KV heads cannot be replicated evenly over 6 ranks"):
        QKVParallelLinear(32, 8, 12, 4, False, TPGroup(0, 6), F32, CPU)


@pytest.mark.parametrize("tp_size,padded", [(1, 320), (2, 384), (4, 512)])
def test_vocab_parallel_embedding(tp_size: int, padded: int, tp_ranks: RunRanks) -> None:
    table = randn(300, 16)
    ids = torch.tensor([0, 63, 64, 191, 192, 255, 256, 299, 5])

    def rank(tp: TPGroup) -> tuple[VocabParallelEmbedding, torch.Tensor]:
        embed = load(VocabParallelEmbedding(300, 16, tp, F32, CPU), ("weight", table, None))
        return embed, embed(ids)

    ranks = tp_ranks(tp_size, rank)
    for embed, out in ranks:  # all-reduced: every rank holds every token's embedding
        assert embed.padded_vocab_size == padded and embed.weight.shape == (padded // tp_size, 16)
        torch.testing.assert_close(out, table[ids])
    rows = torch.cat([embed.weight for embed, _ in ranks])  # rank r holds rows [r, r + 1) * padded / tp
    assert torch.equal(rows[:300], table) and torch.equal(rows[300:], torch.zeros(padded - 300, 16))


@pytest.mark.parametrize("tied", [False, True])
def test_parallel_lm_head_gathers_on_first_rank(tied: bool, tp_ranks: RunRanks) -> None:
    table, hidden = randn(300, 16), randn(3, 16)

    def rank(tp: TPGroup) -> torch.Tensor | None:
        embed = VocabParallelEmbedding(300, 16, tp, F32, CPU)
        head = ParallelLMHead(300, 16, tp, F32, CPU, tied_to=embed if tied else None)
        load(embed if tied else head, ("weight", table, None))
        assert (head.weight is embed.weight) == tied
        return head(hidden)

    logits, *others = tp_ranks(2, rank)
    assert logits.shape == (3, 300) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden @ table.T)
    assert others == [None]


ROPES = {
    "default": dict(rope_type="default", rope_theta=10000.0),
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    "llama3": dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=64),
    "yarn": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128),
    "yarn_mscale": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
                        beta_fast=16, mscale=0.8, mscale_all_dim=0.6),
}


@pytest.mark.parametrize("rope", list(ROPES))
def test_rotary_cache_matches_transformers(rope: str) -> None:
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=512,
                         rope_parameters=dict(ROPES[rope]))
    positions = torch.arange(512)
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=F32), positions[None])
    ours = RotaryEmbedding(64, 512, rope_parameters(config.to_dict()), CPU).cos_sin_cache
    torch.testing.assert_close(ours[:512], torch.cat((cos[0, :, :32], sin[0, :, :32]), -1), atol=2e-6, rtol=0)


def test_rope_parameters_from_legacy_and_missing_keys() -> None:
    legacy = {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 500000.0, "max_position_embeddings": 64}
    assert rope_parameters(legacy) | {"type": None} == {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0,
                                                        "type": None}
    llama31 = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
               "max_position_embeddings": 4096}
    assert rope_parameters(llama31)["original_max_position_embeddings"] == 4096
    assert rope_parameters({"max_position_embeddings": 64}) == {"rope_type": "default", "rope_theta": 10000.0}


@pytest.mark.parametrize("rope_type", ["dynamic", "proportional"])
def test_unsupported_rope_types_are_named(rope_type: str) -> None:
    with pytest.raises(ValueError, match=f"rope type '{rope_type}' is not supported"):
        RotaryEmbedding(64, 128, {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0}, CPU)
