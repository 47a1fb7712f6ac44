"""The compiled CPU kernels for the tests that exercise them. Where they cannot be built here (no
compiler, no ninja) the importing module is skipped with the reason, instead of failing at collection;
``tests/kernels/test_cpu_build.py`` fails wherever a compiler and ninja are at hand and the kernels
still do not load, so a broken build cannot hide behind these skips."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch


def cpu_backend_or_skip():
    """The compiled CPU attention backend (``select_backend("cpu")``), or a skip of the calling module."""
    from kernels.backends import select_backend
    from kernels.cpu import load, load_error

    if load() is None:
        pytest.skip(f"the compiled CPU kernels are unavailable here: {load_error()}", allow_module_level=True)
    return select_backend("cpu", torch.device("cpu"))[0]


@contextmanager
def threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` inside the block, and set back after it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
