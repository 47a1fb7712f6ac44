"""Choosing the attention backend: once per engine, from its ``attention_backend`` setting.

``auto`` takes the compiled CPU kernels on a CPU device when they load (build) here, else plain
torch; ``cpu`` insists on the compiled kernels (a clear error at start where they cannot build);
``torch`` is plain torch on any device.
"""

from __future__ import annotations

import torch

from kernels.attention import AttentionBackend
from kernels.torch_attention import TORCH_BACKEND

BACKENDS = ("auto", "torch", "cpu")


def select_backend(name: str, device: torch.device) -> tuple[AttentionBackend, str]:
    """(backend, one line saying which runs and why)."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "torch":
        return TORCH_BACKEND, "attention backend: torch (asked for)"
    if device.type != "cpu":
        if name == "cpu":
            raise ValueError(f"attention_backend='cpu' runs on a CPU device only, not {device.type}")
        return TORCH_BACKEND, f"attention backend: torch (on {device.type})"
    from kernels.cpu import CpuAttentionBackend, load, load_error

    ops = load()
    if ops is None:
        if name == "cpu":
            raise ValueError(f"attention_backend='cpu': the compiled CPU kernels cannot be built here ({load_error()})")
        return TORCH_BACKEND, f"attention backend: torch (the compiled CPU kernels are unavailable: {load_error()})"
    return CpuAttentionBackend(ops), "attention backend: cpu (compiled, in-place paged attention)"
