"""Activation functions by their Hugging Face config names (``hidden_act``, ``activation_function``)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        supported = ", ".join(_ACTIVATIONS)
        raise NotImplementedError(f"activation {name!r} is not supported (supported: {supported})") from None


def act_and_mul(x: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Gated activation of a fused [gate | up] projection: [T, 2 * d] -> act(gate) * up, [T, d]."""
    gate, up = x.chunk(2, dim=-1)
    return act(gate) * up
