"""top_p and repetition_penalty at the lowest values validation lets through (the smallest normal
float32) sample exactly on the workers: never token 0 out of an underflow, an overflow or a NaN."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.sampling_params import FLOAT32_MIN_NORMAL
from workers.sampler import Sampler, SamplingRow

# token 0 is never the answer: what a row of NaN (or of -inf everywhere) makes argmax pick
LOGITS = [1.0, 3.0, 2.0, 5.0, -1.0]


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 1), (0.5, 3), (2.0, None)])
def test_the_smallest_top_p_keeps_exactly_the_best_token(temperature, seed):
    sampler = Sampler(torch.device("cpu"), seed=0)
    params = SamplingParams(temperature=temperature, top_p=FLOAT32_MIN_NORMAL, seed=seed)
    for _ in range(8):
        ids, _ = sampler(torch.tensor([LOGITS]), [SamplingRow(params, [4], 1, ())])
        assert ids == [3]


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 1), (0.5, 3), (2.0, None)])
def test_the_smallest_repetition_penalty_favours_the_best_seen_token(temperature, seed):
    """Seen tokens 1 and 3 (logits 3 and 5): divided by ~1.2e-38 both pass float32's range; the
    penalty makes token 3 certain (its logit is 2 / 1.2e-38 above token 1's)."""
    sampler = Sampler(torch.device("cpu"), seed=0)
    params = SamplingParams(temperature=temperature, repetition_penalty=FLOAT32_MIN_NORMAL, seed=seed)
    for _ in range(8):
        ids, _ = sampler(torch.tensor([LOGITS]), [SamplingRow(params, [1, 3, 4], 2, ())])
        assert ids == [3]


def test_a_small_repetition_penalty_keeps_the_distribution_of_the_unseen_tokens():
    """Below 1 the penalty is applied in float64 and the row shifted (nothing after it depends on a
    shift): a seen token whose logit is negative (made ~0 by the penalty) against unseen ones keeps
    the exact softmax weights."""
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.tensor([[-4.0, 1.0, 2.0, -3.0]])
    params = SamplingParams(temperature=1.0, repetition_penalty=0.5)
    shifted = sampler._apply_penalties(logits.clone(), [SamplingRow(params, [0, 3], 2, ())])
    expected = torch.tensor([[-2.0, 1.0, 2.0, -1.5]])
    assert torch.allclose(shifted.softmax(-1), expected.softmax(-1), atol=1e-7, rtol=0)
    assert torch.equal(shifted - shifted.max(), expected - expected.max())
