"""Tensor-parallel layers: each parameter carries a ``weight_loader`` reading its rank's part."""

from workers.layers.activation import act_and_mul, activation
from workers.layers.attention import Attention
from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    kv_head_partition,
)
from workers.layers.norm import LayerNorm, RMSNorm
from workers.layers.rotary import RotaryEmbedding, rope_parameters

__all__ = [
    "Attention",
    "ColumnParallelLinear",
    "LayerNorm",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "act_and_mul",
    "activation",
    "kv_head_partition",
    "rope_parameters",
]
