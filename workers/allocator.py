"""glibc malloc settings for a rank's process on CPU.

Every step allocates activations whose sizes follow the batch (tokens x hidden, tokens x
intermediate). By default glibc serves blocks above its (adaptive, 128 KiB - 32 MiB) mmap threshold
with a fresh ``mmap`` and returns them with ``munmap``, and trims the heap top when 128 KiB are free:
each new size then costs page faults on memory the process just gave back. With mmap off and a high
trim threshold, freed blocks stay in the heap and the next step reuses them. Set
``KVSERVE_MALLOC_TUNING=0`` to keep glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_MAX = -4

_applied = False


def tune_malloc(trim_threshold: int = 1 << 30, top_pad: int = 64 << 20) -> bool:
    """Apply the settings once per process; False where libc is not glibc or tuning is off."""
    global _applied
    if _applied:
        return True
    if os.environ.get("KVSERVE_MALLOC_TUNING", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, trim_threshold), (M_TOP_PAD, top_pad)))
    _applied = ok
    if not ok:
        logger.warning("mallopt refused kvserve's settings; glibc's defaults stay")
    return ok
