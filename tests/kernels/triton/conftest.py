"""The Triton kernels of this directory run on CPU tensors under the Triton interpreter.

``TRITON_INTERPRET`` is read when the kernels are decorated (``kernels.triton.ops`` is imported), so
it is set here, before any test module of this directory imports them; not when the run selects the
``gpu`` tests (``-m gpu``), which run the same kernels compiled on CUDA (``tests/gpu``)."""

from __future__ import annotations

import os
import sys


def pytest_configure(config):
    if (config.getoption("markexpr") or "").replace(" ", "") == "gpu":
        return
    assert "kernels.triton.ops" not in sys.modules or sys.modules["kernels.triton.ops"].INTERPRETED, (
        "kernels.triton.ops was imported compiled before the interpreter tests could set TRITON_INTERPRET=1")
    os.environ["TRITON_INTERPRET"] = "1"
