"""The sampler's exponential race never divides by zero: a draw of exactly 0 cannot make a filtered
(zero-probability) token win through a NaN, nor every kept token tie at infinity."""

from __future__ import annotations

import torch

from engine import SamplingParams
from workers.sampler import Sampler, SamplingRow


def test_zero_draws_cannot_pick_a_filtered_token(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "exponential_", lambda self, *a, **k: self.zero_())
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    rows = [SamplingRow(SamplingParams(temperature=1.0, top_k=3), [1, 2], 2, ()),
            SamplingRow(SamplingParams(temperature=0.5, top_k=2, seed=9), [1, 2], 2, ())]
    ids, _ = sampler(logits, rows)
    # every draw is the same, so the most probable kept token wins (never the filtered index)
    assert ids == [0, 3]


def test_a_top_k_beyond_the_vocabulary_keeps_every_token():
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.tensor([[0.0, 0.1, 0.2, 5.0]])
    ids, _ = sampler(logits, [SamplingRow(SamplingParams(temperature=1e-3, top_k=2**31 - 1), [1], 1, ())])
    assert ids == [3]
