"""Compiled CPU kernels (C++ through torch's extension mechanism): in-place paged attention with
shared-prefix groups (``paged_attention.cpp``, its argument checks in ``attention_checks.cpp``) and the KV store
(``kv_store.cpp``), fused RMSNorm, residual add +
RMSNorm, SiLU-and-multiply and rotary (``elementwise.cpp``), on vectors as wide as the machine's registers (``vec.h``).
``make install`` builds them (``python -m kernels.cpu``); ``build.load()`` loads the build, building
first if none matches the sources."""

from kernels.cpu.backend import CpuAttentionBackend
from kernels.cpu.build import build, load, load_error
from kernels.cpu.layer_ops import CpuLayerOps, DecoderStack

__all__ = ["CpuAttentionBackend", "CpuLayerOps", "DecoderStack", "build", "load", "load_error"]
