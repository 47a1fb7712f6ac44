"""Compiled CPU kernels (C++ through torch's extension mechanism, ``paged_attention.cpp``): in-place
paged attention with shared-prefix groups, and the KV store. ``make install`` builds them
(``python -m kernels.cpu``); ``build.load()`` loads the build, building first if none matches."""

from kernels.cpu.backend import CpuAttentionBackend
from kernels.cpu.build import build, load, load_error

__all__ = ["CpuAttentionBackend", "build", "load", "load_error"]
