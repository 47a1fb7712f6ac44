"""Compiled CPU kernels (C++ through torch's extension mechanism): in-place paged attention with
shared-prefix groups, and the KV store. ``make install`` builds them (``python -m kernels.cpu``);
``load()`` loads the build, building first if none matches the sources, and answers None (with
the reason in ``load_error()``) where no compiler or ninja is at hand: the caller then runs the
plain-torch kernels.

Builds live in ``$KVSERVE_KERNEL_CACHE`` (default ``~/.cache/kvserve/kernels``), one directory per
hash of the sources, the flags, the torch version and this CPU's instruction sets, since the code
is compiled for the machine that builds it (``-march=native``). A file lock lets concurrent
processes (Ray actors starting together) share one build.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import sys
import threading
from pathlib import Path

import torch

NAME = "kvserve_cpu"
SOURCES = tuple(Path(__file__).parent / name for name in (
    "vec.h", "ops.h", "group_attention.h", "paged_attention.cpp", "group_attention.cpp", "elementwise.cpp",
    "linear.cpp", "decoder_stack.cpp", "gemm.h", "gemm.cpp"))
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=fast")

_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build_dir() -> Path:
    digest = hashlib.sha256()
    for source in SOURCES:
        digest.update(source.read_bytes())
    for part in (*CFLAGS, torch.__version__, sys.version, _cpu_flags()):
        digest.update(part.encode())
    root = Path(os.environ.get("KVSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "kvserve" / "kernels")
    return root / f"{NAME}-{digest.hexdigest()[:16]}"


def _library(directory: Path) -> Path:
    return directory / f"{NAME}.so"


def build(verbose: bool = False) -> Path:
    """Compile the kernels unless a build of these sources exists; returns the shared library."""
    from torch.utils import cpp_extension

    directory = build_dir()
    library = _library(directory)
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    bin_dir = str(Path(sys.executable).parent)  # ninja from the venv, if installed there
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():
            return library
        if shutil.which("ninja") is None:
            raise RuntimeError("ninja is not installed")
        work = directory / "work"
        work.mkdir(exist_ok=True)
        cpp_extension.load(
            name=NAME, sources=[str(s) for s in SOURCES if s.suffix == ".cpp"], extra_cflags=list(CFLAGS) + ["-fopenmp"],
            extra_ldflags=["-fopenmp"], build_directory=str(work), is_python_module=False, verbose=verbose,
        )
        built = work / f"{NAME}.so"
        tmp = directory / f".{NAME}.so.tmp"
        shutil.copyfile(built, tmp)
        os.replace(tmp, library)
    return library


def load() -> object | None:
    """``torch.ops.kvserve_cpu`` with the kernels registered, or None if they cannot be built here."""
    with _lock:
        if "ops" in _state:
            return _state["ops"]
        ops = None
        try:
            if not hasattr(torch.ops.kvserve_cpu, "paged_attention"):
                torch.ops.load_library(str(build()))
            ops = torch.ops.kvserve_cpu
        except Exception as exc:  # no compiler, no ninja, a failed build: the torch kernels run instead
            _state["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        _state["ops"] = ops
        return ops


def load_error() -> str | None:
    """Why ``load()`` answered None (None if it has not failed)."""
    return _state.get("error")  # type: ignore[return-value]
