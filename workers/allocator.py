"""Memory settings for a rank's process on CPU: glibc malloc, and huge pages for the large arrays.

Every step allocates activations whose sizes follow the batch (tokens x hidden, tokens x
intermediate). By default glibc serves blocks above its (adaptive, 128 KiB - 32 MiB) mmap threshold
with a fresh ``mmap`` and returns them with ``munmap``, and trims the heap top when 128 KiB are free:
each new size then costs page faults on memory the process just gave back. With mmap off and a high
trim threshold, freed blocks stay in the heap and the next step reuses them. Set
``KVSERVE_MALLOC_TUNING=0`` to keep glibc's defaults.

The KV pool and the linear weights are read in 4 KiB pieces spread over gigabytes (a KV block of one
layer is one page; prefix caching hands blocks out in eviction order, so a sequence's blocks are
scattered): with 4 KiB pages nearly every block is a TLB miss. ``huge_empty`` asks the kernel for
transparent huge pages (2 MiB) on such arrays before their first touch (``madvise``; a no-op where
THP is off): scattered-block decode attention measured 0.359 -> 0.271 ms per layer.

The KV pool must start zeroed (the null block is multiplied by masked attention), and zeroing it
with a write touches every page at start: 2 GiB per rank took 1.4-4.9 s on the 2-core VM (first
touches of a VM's memory are slow), the largest part of a rank's start and so of every recovery.
``zeroed_mapping`` takes fresh anonymous memory instead, which the kernel hands out zero-filled;
``prefault_in_background`` then maps its pages from a daemon thread under SCHED_IDLE
(``MADV_POPULATE_WRITE``, which never changes what a page holds, so it can run while the engine
writes KV): the pool becomes resident on cores that would otherwise idle, as a zeroed one would be
at start, without the start or the steps waiting for it. Where huge pages map slowly (memory a VM's
host has not backed yet: about fifteen times slower than recycled 4 KiB pages), the thread advises the rest of
the pool off them and it maps in 4 KiB pages (``prefault_in_background``'s ``min_huge_rate``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import os
import threading
import time

import torch

logger = logging.getLogger(__name__)

MADV_HUGEPAGE = 14
MADV_NOHUGEPAGE = 15
MADV_POPULATE_WRITE = 23  # Linux 5.14+
PREFAULT_CHUNK = 2 << 20
# huge pages of a pool are kept while its chunks map at least this fast: warm memory maps
# 2 MiB pages at ~3 GiB/s on the 2-core VM, memory its host has not yet backed at ~0.3 GiB/s (4 KiB
# pages of either at ~4.5 GiB/s)
HUGE_PAGE_MIN_RATE = 1 << 30
HUGE_PAGE = 2 << 20
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_MAX = -4

_applied = False


@functools.cache
def _libc_function(name: str):
    """The C library's function ``name`` (errno kept for it), or None where there is no such library or
    function (not glibc, not Linux)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True), name)
    except (OSError, AttributeError):
        return None


def _libc_madvise():
    madvise = _libc_function("madvise")
    if madvise is not None:
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask for transparent huge pages on the 2 MiB-aligned part of a CPU tensor's memory; True if the
    kernel took the advice. Call before the memory is first touched."""
    madvise = _libc_madvise()
    if not madvise or tensor.device.type != "cpu":
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = (start + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    length = (end - first) & ~(HUGE_PAGE - 1)
    return length > 0 and madvise(first, length, MADV_HUGEPAGE) == 0


def huge_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty`` on CPU, backed by huge pages where the kernel allows."""
    tensor = torch.empty(shape, dtype=dtype)
    advise_huge_pages(tensor)
    return tensor


def zeroed_mapping(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor on fresh anonymous memory (2 MiB-aligned, huge pages advised), whose
    pages are faulted in on first touch: nothing is written at allocation."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps ``region`` alive as long as any view
    offset = (-raw.data_ptr()) % HUGE_PAGE
    tensor = raw[offset:offset + nbytes].view(dtype).view(shape)
    advise_huge_pages(tensor)
    return tensor


def _lowest_priority() -> None:
    """Put the calling thread under SCHED_IDLE (else nice 19): it runs only on cores nothing else wants."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread, on Linux
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass


def prefault_chunks(start: int, end: int, regions: int = 1, chunk: int = PREFAULT_CHUNK) -> list[tuple[int, int]]:
    """The (address, length) pieces that map [start, end), in the order to map them: the range is
    ``regions`` equal parts (a KV pool's layer halves), and the first ``chunk`` bytes of every part come
    before the second of any (each piece page-aligned; neighbours may overlap by a page)."""
    size = (end - start) // max(regions, 1)
    if regions <= 1 or size <= 0:
        return [(a, min(chunk, end - a)) for a in range(start, end, chunk)]
    pieces = []
    for offset in range(0, size, chunk):
        for r in range(regions):
            lo = start + r * size + offset
            hi = min(lo + chunk, start + (r + 1) * size if r + 1 < regions else end)
            aligned = lo & ~(mmap.PAGESIZE - 1)
            pieces.append((aligned, hi - aligned))
    tail = start + regions * size  # bytes past the equal parts (none for a pool)
    pieces += [(a & ~(mmap.PAGESIZE - 1), min(chunk, end - a)) for a in range(tail, end, chunk)]
    return pieces


def prefault_in_background(tensor: torch.Tensor, name: str = "kv-prefault", regions: int = 1,
                           min_huge_rate: float | None = None) -> threading.Thread | None:
    """Map every page of ``tensor`` from a daemon thread, a chunk at a time, without writing to it;
    None where the kernel cannot (before 5.14) and the pages are mapped as they are first touched.
    ``regions``: the tensor is that many equal parts (a KV pool: one per layer and K or V, each
    indexed by block id), mapped side by side, chunk k of every part before chunk k + 1 of any: in the
    order the pool hands blocks out (low ids first), so the steps meet mapped pages sooner than if
    the last layer's came last.

    ``min_huge_rate`` (bytes per second of the thread's CPU time): once a chunk maps slower, the tensor
    is advised off huge pages (``MADV_NOHUGEPAGE``; those mapped stay), so that the rest maps in 4 KiB
    pages. Why: a 2 MiB page is zeroed and mapped whole on first touch, and where a virtual machine's
    host backs guest memory only when first used, the huge pages the guest hands out once its recently
    freed ones are gone are memory never used before: on the 2-core VM a huge-advised 1 GiB took 3.1 s
    to touch the first time in a process and 0.34 s the second, while 4 KiB pages (recycled warm ones)
    took 0.2 s. A pool mapped at that pace slowed the steps running beside the thread up to 1.7x (PP 2
    prefill, each stage's pool mapping through the run), though the thread ran under SCHED_IDLE; and
    the steps' own first touches of it cost a caching-on prefill a third of its time. Where memory maps
    fast the huge pages stay (long-context decode ran 3-4% faster on them)."""
    madvise = _libc_madvise()
    if not madvise or tensor.device.type != "cpu":
        return None
    start = tensor.data_ptr() & ~(mmap.PAGESIZE - 1)
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    pieces = prefault_chunks(start, end, regions)

    def run() -> None:
        _lowest_priority()  # runs where the cores would idle: the start and the steps do not wait for it
        huge = min_huge_rate is not None
        for address, length in pieces:
            began = time.thread_time()  # this thread's CPU time: the waits for a core left out
            if madvise(address, length, MADV_POPULATE_WRITE) != 0:
                logger.debug("MADV_POPULATE_WRITE refused (errno %d): pages map on first touch",
                             ctypes.get_errno())
                return
            spent = time.thread_time() - began
            if huge and length >= HUGE_PAGE and length <= min_huge_rate * spent:
                huge = False
                if madvise(start, end - start, MADV_NOHUGEPAGE) != 0:
                    return  # pages map on first touch, huge where the kernel gives them
                logger.info("%s: huge pages mapped at %.2f GiB/s (memory new to this machine's host): "
                            "the rest maps in 4 KiB pages", name, length / max(spent, 1e-9) / (1 << 30))

    thread = threading.Thread(target=run, name=name, daemon=True)  # ctypes calls release the GIL
    thread.start()
    return thread


def tune_malloc(trim_threshold: int = 1 << 30, top_pad: int = 64 << 20) -> bool:
    """Apply the settings once per process; False where libc is not glibc or tuning is off."""
    global _applied
    if _applied:
        return True
    if os.environ.get("KVSERVE_MALLOC_TUNING", "1") == "0":
        return False
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, trim_threshold), (M_TOP_PAD, top_pad)))
    _applied = ok
    if not ok:
        logger.warning("mallopt refused kvserve's settings; glibc's defaults stay")
    return ok


def release_free_heap() -> bool:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim(0)``, which also returns
    whole free pages inside the heap); False where libc is not glibc. With the settings above nothing
    freed goes back by itself: after a rank lays its weights out anew for the compiled linear (a copy of
    each, the original freed), the originals' memory stayed resident, half again the weights (a 2.3 GiB
    checkpoint in one process: 3.9 GiB anonymous after start, 3.1 GiB with this call after the relayout)."""
    trim = _libc_function("malloc_trim")
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True

