"""Vocabulary-parallel token embedding and LM head.

The vocabulary is padded to a multiple of 64 * tp so every rank holds the same number of rows::

    rows:  [ rank 0 | rank 1 | ... | rank tp-1 ]      each padded_vocab / tp rows
           0 ........................ vocab_size ... padded_vocab   (padding rows are zero)
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from workers.layers.linear import new_param
from workers.parallel_state import TPGroup
from workers.weight_loader import ShardId, WeightSlice, copy_weight

PAD_MULTIPLE = 64


class VocabParallelEmbedding(nn.Module):
    """Token embedding with vocabulary rows split across ranks: [T] ids -> [T, dim], all-reduced.

    Each rank embeds the ids in its row range ``[vocab_start, vocab_end)`` and zeros the others,
    so the all-reduce sums exactly one contribution per token.
    """

    def __init__(
        self, vocab_size: int, embedding_dim: int, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.vocab_size, self.tp = vocab_size, tp
        multiple = PAD_MULTIPLE * tp.size
        self.padded_vocab_size = -(-vocab_size // multiple) * multiple
        self.vocab_start, self.vocab_end = tp.shard(self.padded_vocab_size, "padded vocabulary")
        self.weight = new_param((self.vocab_end - self.vocab_start, embedding_dim), dtype, device, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, weight: WeightSlice, shard_id: ShardId = None) -> None:
        if weight.get_shape()[0] != self.vocab_size:
            raise ValueError(f"checkpoint has {weight.get_shape()[0]} vocabulary rows, config says {self.vocab_size}")
        rows = max(0, min(self.vocab_end, self.vocab_size) - self.vocab_start)
        if rows:
            copy_weight(param.data[:rows], weight[self.vocab_start : self.vocab_start + rows])
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        out = F.embedding((input_ids - self.vocab_start) * in_range, self.weight)
        return self.tp.all_reduce(out.masked_fill_(~in_range.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection with the embedding's row split: [N, dim] -> [N, vocab_size] float32 logits on
    rank 0 (None elsewhere), each rank computing its rows and rank 0 gathering them.

    ``tied_to`` shares that embedding's weight (and its loading) instead of holding one.
    """

    def __init__(
        self,
        vocab_size: int,
        embedding_dim: int,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
        tied_to: VocabParallelEmbedding | None = None,
    ) -> None:
        # A tied head allocates its own weight on the meta device only, then takes the embedding's.
        super().__init__(vocab_size, embedding_dim, tp, dtype, device if tied_to is None else torch.device("meta"))
        if tied_to is not None:
            self.weight = tied_to.weight
        self.packed_weight: torch.Tensor | None = None  # see workers.layers.kernels
        self.linear = F.linear  # or the compiled CPU linear (``workers.layers.kernels``)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        weight = self.weight if self.packed_weight is None else self.packed_weight
        logits = self.tp.gather_to_first(self.linear(hidden, weight, None))
        return None if logits is None else logits[:, : self.vocab_size].float()
