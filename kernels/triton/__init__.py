"""Triton kernels for the GPU path (``ops``: paged attention with split-KV, the KV store, RMSNorm
with the residual add, SiLU-and-multiply, neox rotary) and the ``triton`` attention backend.

Triton is optional and imported lazily: importing this package does not import it. The kernels run
compiled on CUDA tensors, or on CPU tensors under the Triton interpreter when ``TRITON_INTERPRET=1``
is set before the first use (the variable is read when the kernels are decorated).
"""

from __future__ import annotations

import importlib
import os

_error: str | None = None
_checked = False


def load_error() -> str | None:
    """None where Triton imports, else why not (one line)."""
    global _error, _checked
    if not _checked:
        _checked = True
        try:
            importlib.import_module("triton")
            importlib.import_module("triton.language")
        except Exception as exc:  # ImportError, or a broken install failing on import
            _error = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return _error


def interpreted() -> bool:
    """Whether the kernels run under the Triton interpreter (fixed when ``ops`` is first imported)."""
    import sys

    ops = sys.modules.get("kernels.triton.ops")
    if ops is not None:
        return ops.INTERPRETED
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def __getattr__(name: str):
    if name in ("TritonAttentionBackend", "TritonLayerOps"):
        from kernels.triton import backend

        return getattr(backend, name)
    raise AttributeError(f"module 'kernels.triton' has no attribute {name!r}")


__all__ = ["TritonAttentionBackend", "TritonLayerOps", "interpreted", "load_error"]
