"""glibc settings of a CPU rank: large blocks come from the heap and stay there for reuse."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

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


TRIM_PROBE = """
import torch
from workers.allocator import release_free_heap, tune_malloc

def anon():
    return int(open("/proc/self/status").read().split("RssAnon:")[1].split()[0]) << 10

assert tune_malloc()
keep = torch.ones(1 << 20)  # allocated after the block below: the heap's top stays in use
weights = [torch.ones(16 << 20) for _ in range(4)]  # 256 MiB, touched
keep2 = torch.ones(1 << 20)
before = anon()
del weights  # freed in the middle of the heap: kept resident for reuse
freed = anon()
print(before - freed, int(release_free_heap()), before - anon())
"""


def test_the_free_heap_goes_back_to_the_system_when_asked():
    """What the malloc settings keep (freed blocks in the middle of the heap stay resident) goes back
    with release_free_heap: a rank calls it once its weights' original layouts are freed."""
    out = subprocess.run([sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True, check=True)
    kept_free, released, returned = (int(x) for x in out.stdout.split())
    assert kept_free < 16 << 20 and released == 1  # nothing went back by itself
    assert returned > 240 << 20  # then nearly all of the 256 MiB


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


POOL_PROBE = """
import gc, sys, torch
from workers.allocator import HUGE_PAGE, prefault_in_background, tune_malloc, zeroed_mapping

def status_kb(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1])

def anon_huge_kb():
    return int(open("/proc/self/smaps_rollup").read().split("AnonHugePages:")[1].split()[0])

tune_malloc()  # as on a rank: malloc's heap would hand back used memory; the mapping is fresh
dirty = torch.empty(64 << 20, dtype=torch.uint8).fill_(0xAB)
del dirty
rss, huge = status_kb("VmRSS:"), anon_huge_kb()
pool = zeroed_mapping((64, 1 << 20), torch.float32)  # 256 MiB
assert pool.shape == (64, 1 << 20) and pool.dtype == torch.float32 and pool.is_contiguous()
assert pool.data_ptr() % HUGE_PAGE == 0
grew_by_allocating = status_kb("VmRSS:") - rss
pool[17, 123] = 1.5
view = pool[16:48]  # 128 MiB (rows of 4 MiB); row 17 written before the prefault, which must not undo it
del pool
gc.collect()  # a view keeps the mapping alive
view[0, 0] = 3.0
thread = prefault_in_background(view, regions=4)  # as a pool: its layers' parts side by side
thread.join(timeout=120)
print(grew_by_allocating, status_kb("VmRSS:") - rss, anon_huge_kb() - huge,
      float(view[0, 0]), float(view[1, 123]), float(view.sum()), thread.is_alive())
"""


def test_the_kv_pool_mapping_is_zeroed_untouched_and_prefaulted_in_place():
    """A fresh mapping: zeros though malloc's heap held dirty memory, nothing resident until touched;
    the background prefault makes all of it resident without changing a value written before."""
    out = subprocess.run([sys.executable, "-c", POOL_PROBE], capture_output=True, text=True, check=True)
    grew, resident, huge_kb, first, before, total, alive = out.stdout.split()
    assert int(grew) < 8 * 1024  # KiB: the 128 MiB view's pages were not touched by the allocation
    assert alive == "False"
    assert int(resident) >= 127 * 1024  # the 128 MiB view became resident
    assert float(first) == 3.0 and float(before) == 1.5 and float(total) == 4.5  # zeros elsewhere
    setting = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    if "[never]" not in setting:
        assert int(huge_kb) >= 126 * 1024


SLOW_HUGE_PROBE = """
import sys, torch
from workers.allocator import prefault_in_background, zeroed_mapping

def anon_huge_kb():
    return int(open("/proc/self/smaps_rollup").read().split("AnonHugePages:")[1].split()[0])

def rss_kb():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1])

rate = float(sys.argv[1])
huge, rss = anon_huge_kb(), rss_kb()
pool = zeroed_mapping((8, 16 << 20), torch.uint8)  # 128 MiB: eight parts of 16 MiB
thread = prefault_in_background(pool, regions=8, min_huge_rate=rate)
thread.join(timeout=120)
print(anon_huge_kb() - huge, rss_kb() - rss, int(pool.sum()), thread.is_alive())
"""


def test_a_pool_whose_huge_pages_map_slowly_maps_the_rest_in_small_pages():
    """Memory new to a VM's host maps huge pages ten times slower than small ones: once a 2 MiB chunk
    maps slower than ``min_huge_rate`` the rest of the pool is advised off huge pages (the chunk
    already mapped stays huge). A rate no chunk misses (0) keeps every huge page. Either way the whole
    pool becomes resident, zeros."""
    runs = {}
    for rate in ("1e18", "0"):  # every chunk too slow / none
        out = subprocess.run([sys.executable, "-c", SLOW_HUGE_PROBE, rate], capture_output=True, text=True, check=True)
        huge_kb, resident_kb, total, alive = out.stdout.split()
        assert total == "0" and alive == "False"
        assert int(resident_kb) >= 127 * 1024  # all 128 MiB mapped
        runs[rate] = int(huge_kb)
    assert runs["1e18"] <= 2 * 1024  # the first chunk only
    assert runs["0"] >= 126 * 1024


def test_the_prefault_maps_the_parts_of_a_pool_side_by_side_and_misses_no_page():
    from workers.allocator import prefault_chunks

    mib = 1 << 20
    # four parts of 5 MiB: the first 2 MiB of each, then the next 2 MiB of each, then the last 1 MiB
    pieces = prefault_chunks(0, 20 * mib, 4, chunk=2 * mib)
    assert [a // mib for a, _ in pieces] == [0, 5, 10, 15, 2, 7, 12, 17, 4, 9, 14, 19]
    assert [n // mib for _, n in pieces] == [2] * 8 + [1] * 4
    assert prefault_chunks(0, 5 * mib, 1, chunk=2 * mib) == [(0, 2 * mib), (2 * mib, 2 * mib), (4 * mib, mib)]
    page = 4096
    for start, end, regions, chunk in [(page, page + 3 * 1_000_000 + 7, 3, 1 << 19), (0, 10 * page + 1, 7, 2 * page),
                                        (8 * page, 9 * page, 4, page)]:
        pieces = prefault_chunks(start, end, regions, chunk)
        assert all(a % page == 0 and n > 0 for a, n in pieces)
        covered = {p for a, n in pieces for p in range(a // page, (a + n + page - 1) // page)}
        assert covered >= set(range(start // page, (end + page - 1) // page))
        assert all(start - page < a and a + n <= end for a, n in pieces)  # nothing outside the range


def test_the_cpu_kv_pool_starts_zeroed():
    import torch

    from workers.kv_pool import KVPoolSpec, allocate_kv_pool

    spec = KVPoolSpec(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    layers = allocate_kv_pool(spec, 9, torch.device("cpu"), prefault=True)
    assert len(layers) == 2
    for k, v in layers:
        assert k.shape == v.shape == (9, 4, 2, 8)
        assert not k.any() and not v.any()
    layers[0][0][3].fill_(1.0)
    assert float(layers[0][0].sum()) == 4 * 2 * 8 and not layers[1][0].any()
