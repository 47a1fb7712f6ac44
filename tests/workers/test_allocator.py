"""glibc settings of a CPU rank: large blocks come from the heap and stay there for reuse."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import ctypes, sys
from workers.allocator import tune_malloc

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
applied = tune_malloc()
before = libc.mallinfo2()
block = libc.malloc(64 << 20)
during = libc.mallinfo2()
libc.free(block)
after = libc.mallinfo2()
mapped = during.hblkhd - before.hblkhd  # bytes served by mmap
kept = after.arena - before.arena  # heap bytes still held after the free
print(applied, mapped, kept)
"""


def probe(tuning: str) -> tuple[str, int, int]:
    env = dict(os.environ, KVSERVE_MALLOC_TUNING=tuning)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    applied, mapped, kept = out.stdout.split()
    return applied, int(mapped), int(kept)


def test_large_blocks_come_from_the_heap_and_stay():
    applied, mapped, kept = probe("1")
    assert applied == "True"
    assert mapped == 0  # no mmap for a 64 MiB block
    assert kept >= 64 << 20  # freed, but kept for the next step


def test_defaults_when_switched_off():
    applied, mapped, kept = probe("0")
    assert applied == "False"
    assert mapped >= 64 << 20  # glibc maps a block this large by default


HUGE_PROBE = """
import torch
from workers.allocator import huge_empty

def anon_huge_kb():
    return int(open("/proc/self/smaps_rollup").read().split("AnonHugePages:")[1].split()[0])

before = anon_huge_kb()
pool = huge_empty((64, 1 << 20), torch.float32).zero_()  # 256 MiB, touched after the advice
print(anon_huge_kb() - before)
"""


def test_large_arrays_get_huge_pages_where_the_kernel_offers_them():
    setting = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    out = subprocess.run([sys.executable, "-c", HUGE_PROBE], capture_output=True, text=True, check=True)
    huge_kb = int(out.stdout.split()[-1])
    if "[never]" in setting:
        assert huge_kb == 0
    else:  # "always" or "madvise": the advised range is backed by 2 MiB pages (all but the unaligned ends)
        assert huge_kb >= 250 * 1024
