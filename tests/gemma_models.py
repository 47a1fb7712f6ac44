"""The tiny Gemma 2 and Gemma 3 checkpoints of the Gemma tests, built once per process (with the
project's model builder) beside their Hugging Face oracles; not in ``tests/conftest.py``'s ARCHS, which
every architecture-parametrised test runs."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

GEMMA_ARCHS = ("gemma2", "gemma3")
_DIRS: dict[str, str] = {}
_ORACLES: dict = {}


def gemma_dir(arch: str) -> str:
    """The directory of ``arch``'s tiny preset (gemma2: head size 256, window 48; gemma3: window 40)."""
    if arch not in _DIRS:
        from workers.model_builder import make_model

        root = Path(tempfile.mkdtemp(prefix="kvserve-gemma-"))
        atexit.register(shutil.rmtree, root, True)
        _DIRS[arch] = str(make_model(arch, "tiny", root / f"{arch}-tiny", seed=0))
    return _DIRS[arch]


def gemma_oracle(arch: str):
    """transformers on ``gemma_dir(arch)`` (``tests.conftest.HFOracle``: float32, eager attention)."""
    from tests.conftest import HFOracle

    if arch not in _ORACLES:
        _ORACLES[arch] = HFOracle(gemma_dir(arch))
    return _ORACLES[arch]
