"""Choosing the attention backend: once per engine, from its ``attention_backend`` setting.

``auto`` takes plain torch on a CUDA device (the Triton kernels become its choice there once they have
run compiled on a GPU; until then they are asked for by name), and the compiled CPU kernels on a CPU
device when they load (build) here, else plain torch; ``cpu`` insists on the
compiled kernels (a clear error at start where they cannot build); ``triton`` insists on the Triton
kernels (a clear error at start where Triton does not import, or on a CPU device unless the Triton
interpreter is on: ``TRITON_INTERPRET=1``); ``torch`` is plain torch on any device.
"""

from __future__ import annotations

import torch

from kernels.metadata import AttentionBackend
from kernels.torch_attention import TORCH_BACKEND

BACKENDS = ("auto", "torch", "cpu", "triton")


def _triton(device: torch.device) -> tuple[AttentionBackend | None, str]:
    """(the Triton backend, "") where it can run on ``device``, else (None, why not)."""
    import kernels.triton as kt

    error = kt.load_error()
    if error is not None:
        return None, f"Triton does not import ({error})"
    if device.type == "cpu" and not kt.interpreted():
        return None, "on a CPU device Triton runs only under its interpreter (set TRITON_INTERPRET=1 before start)"
    if device.type not in ("cpu", "cuda"):
        return None, f"Triton runs on CUDA devices, not {device.type}"
    return kt.TritonAttentionBackend(), ""


def deterministic_error(backend: AttentionBackend, dtype: torch.dtype) -> str | None:
    """Why ``backend`` cannot give batch-invariant results (``deterministic=True``) here, or None."""
    if not getattr(backend, "supports_deterministic", False):
        why = {
            "torch": ("plain torch's linear layers reach BLAS, which picks its kernel and its blocking from the "
                      "number of rows, and its decode attention pads each slice to the slice's longest context"),
        }.get(backend.name, "its reductions depend on the batch")
        return (f"deterministic=True needs attention_backend 'cpu' (the compiled CPU kernels) or 'triton': with "
                f"the {backend.name} backend {why}")
    allowed = getattr(backend, "deterministic_dtypes", (torch.float32,))
    if dtype not in allowed:
        names = " or ".join(str(d).removeprefix("torch.") for d in allowed)
        return (f"deterministic=True with the {backend.name} backend runs {names} models only, "
                f"not {str(dtype).removeprefix('torch.')}")
    return None


def select_backend(name: str, device: torch.device) -> tuple[AttentionBackend, str]:
    """(backend, one line saying which runs and why)."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "torch":
        return TORCH_BACKEND, "attention backend: torch (asked for)"
    if name == "triton":
        backend, why = _triton(device)
        if backend is None:
            raise ValueError(f"attention_backend='triton' cannot run here: {why}")
        mode = "interpreted" if device.type == "cpu" else "compiled"
        return backend, f"attention backend: triton (asked for, {mode}, in-place paged attention)"
    if device.type != "cpu":
        if name == "cpu":
            raise ValueError(f"attention_backend='cpu' runs on a CPU device only, not {device.type}")
        if device.type == "cuda":
            # the Triton kernels become the default on CUDA once they have run compiled on a GPU;
            # until then they are asked for by name
            return TORCH_BACKEND, ("attention backend: torch (on cuda; attention_backend='triton' selects the "
                                   "Triton kernels)")
        return TORCH_BACKEND, f"attention backend: torch (on {device.type})"
    from kernels.cpu import CpuAttentionBackend, load, load_error

    ops = load()
    if ops is None:
        if name == "cpu":
            raise ValueError(f"attention_backend='cpu': the compiled CPU kernels cannot be built here ({load_error()})")
        return TORCH_BACKEND, f"attention backend: torch (the compiled CPU kernels are unavailable: {load_error()})"
    return CpuAttentionBackend(ops), "attention backend: cpu (compiled, in-place paged attention)"
