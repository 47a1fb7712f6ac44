"""Compiled CPU kernels (C++ through torch's extension mechanism): in-place paged attention with
shared-prefix groups, and the KV store. ``make install`` builds them (``python -m kernels.cpu``);
``load()`` loads the build, building first if none matches the sources, and answers None (with
the reason in ``load_error()`` and in the log) where no compiler or ninja is at hand or the build
fails: the caller then runs the plain-torch kernels.

Builds live in ``$KVSERVE_KERNEL_CACHE`` (default ``~/.cache/kvserve/kernels``), one directory per
hash of the sources, the flags, the torch version and this CPU's instruction sets, since the code
is compiled for the machine that builds it (``-march=native``, or ``$KVSERVE_CPU_ARCH``). A file
lock lets concurrent processes (Ray actors starting together) share one build.

The compiler runs in a child process (``python -m kernels.cpu --compile DIR``): torch's
extension mechanism loads what it builds into the building process, and a library whose ops
register the ``kvserve_cpu`` namespace can be loaded once per process only (a second load aborts
the process). The child's whole output is kept in the build directory's ``build.log``; a failed
build's reason names the compiler's first errors.

OpenMP: the kernels' parallel regions (``at::parallel_for``, inlined from torch's headers) must run
on the OpenMP runtime torch itself uses, or ``torch.set_num_threads`` does not reach them and two
thread pools compete for the cores. The library is linked against the runtime torch loaded in this
process (``openmp_runtime()``; wheels often carry their own renamed copy), not the compiler's default,
and clang, whose OpenMP code needs LLVM's runtime, is refused beside a torch on GCC's libgomp.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

NAME = "kvserve_cpu"
SOURCES = tuple(Path(__file__).parent / name for name in (
    "vec.h", "ops.h", "group_attention.h", "kv_quant.h", "kv_store.h", "attention_checks.h", "paged_attention.cpp",
    "kv_store.cpp", "attention_checks.cpp", "group_attention.cpp",
    "elementwise.cpp", "linear.cpp", "decoder_stack.cpp", "gemm.h", "gemm.cpp", "gemm_amx.cpp", "threads.cpp", "moe.cpp",
    "registration.cpp"))
_ARM = platform.machine().lower() in ("arm64", "aarch64")


def target_arch() -> str:
    """The CPU the code is built for: ``native`` (this machine's), or the target ``$KVSERVE_CPU_ARCH``
    names (``x86-64-v3`` for AVX2 without AVX-512, say: one build for a cluster's older nodes, or the
    tests' second build)."""
    return os.environ.get("KVSERVE_CPU_ARCH", "").strip() or "native"


def cflags() -> tuple[str, ...]:
    """The compiler flags, for ``target_arch()`` (``-march``; ``-mcpu`` on ARM, which GCC and clang both
    take there). The stack protector turns a write past a kernel's stack arrays into an abort instead of
    corruption."""
    arch = target_arch()
    return ("-O3", f"-mcpu={arch}" if _ARM else f"-march={arch}", "-fno-math-errno", "-ffp-contract=fast",
            "-fstack-protector-strong")


_OPENMP_NAME = re.compile(r"^lib(gomp|omp|iomp5)\b.*\.(so(\.\d+)*|dylib)$")

_lock = threading.Lock()
_state: dict[str, object] = {}


class BuildError(RuntimeError):
    """The kernels could not be built here; the message says why in one sentence."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


@functools.lru_cache(maxsize=1)
def openmp_runtime() -> Path | None:
    """The OpenMP runtime torch's library runs on in this process: of the OpenMP libraries mapped
    after ``import torch``, the one inside torch's own directories (its wheel's copy) if there is one,
    else the first (a system runtime torch links); on systems without ``/proc``, the one torch's wheel
    carries. None if none is found."""
    root = Path(torch.__file__).parent
    torch_dirs = (root / "lib", root.parent / "torch.libs", root / ".dylibs")
    mapped: list[Path] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if line.count("/") else ""
                if _OPENMP_NAME.match(os.path.basename(path)) and Path(path) not in mapped:
                    mapped.append(Path(path))
    except OSError:
        pass
    for path in mapped:
        if path.parent in torch_dirs:
            return path
    if mapped:
        return mapped[0]
    for directory in torch_dirs:
        if directory.is_dir():
            for candidate in sorted(directory.iterdir()):
                if _OPENMP_NAME.match(candidate.name):
                    return candidate
    return None


def openmp_flags(system: str, runtime: Path | None) -> tuple[list[str], list[str]]:
    """(compile flags, link flags) that build OpenMP code against ``runtime`` (torch's), on ``system``
    (``platform.system()``). Apple's clang takes OpenMP pragmas only through the preprocessor flag;
    with no runtime of torch's found, the compiler's own is linked (``-fopenmp``)."""
    compile_flags = ["-Xpreprocessor", "-fopenmp"] if system == "Darwin" else ["-fopenmp"]
    if runtime is None:
        return compile_flags, (["-lomp"] if system == "Darwin" else ["-fopenmp"])
    return compile_flags, [str(runtime), f"-Wl,-rpath,{runtime.parent}"]


def _openmp_mismatch(compiler: str, env: dict[str, str], runtime: Path | None) -> str | None:
    """Why ``compiler``'s OpenMP code cannot run on torch's runtime, or None: clang compiles OpenMP
    regions into calls to LLVM's runtime (``__kmpc_*``), which GCC's libgomp does not have, so beside
    a torch on libgomp its kernels would bring a second runtime (or not load)."""
    if runtime is None or not runtime.name.startswith("libgomp"):
        return None
    try:
        version = subprocess.run([*shlex.split(compiler), "--version"], capture_output=True, text=True, env=env,
                                 timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None  # the build itself will say what is wrong with the compiler
    if "clang" not in version.lower():
        return None
    return (f"{compiler!r} is clang, whose OpenMP code needs LLVM's runtime, and torch here runs on GCC's libgomp "
            f"({runtime.name}): build with g++ (set CXX=g++)")


def build_dir() -> Path:
    digest = hashlib.sha256()
    for source in SOURCES:
        digest.update(source.read_bytes())
    runtime = openmp_runtime()
    # the machine's instruction sets matter where the code is built for it (native, named or not), not
    # for a named target: nodes of one target share its build whatever else their CPUs have
    native = target_arch() == "native"
    for part in (*cflags(), torch.__version__, sys.version, _cpu_flags() if native else "",
                 runtime.name if runtime else "-fopenmp"):
        digest.update(part.encode())
    root = Path(os.environ.get("KVSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "kvserve" / "kernels")
    return root / f"{NAME}-{digest.hexdigest()[:16]}"


def _library(directory: Path) -> Path:
    return directory / f"{NAME}.so"


def _compiler_errors(log: str) -> str:
    """The compiler's first error lines of a build log (else its last lines), joined into one."""
    errors = [line.strip() for line in log.splitlines() if re.search(r"\berror\b", line) and "ninja" not in line]
    lines = errors[:3] or [line.strip() for line in log.splitlines() if line.strip()][-3:]
    return " | ".join(lines) or "no output"


def compile_here(work: Path, verbose: bool) -> Path:
    """Compile into ``work`` in this process (``build``'s child, ``python -m kernels.cpu --compile``);
    returns the built library."""
    from torch.utils import cpp_extension

    compile_flags, link_flags = openmp_flags(platform.system(), openmp_runtime())
    cpp_extension.load(
        name=NAME, sources=[str(s) for s in SOURCES if s.suffix == ".cpp"],
        extra_cflags=list(cflags()) + compile_flags, extra_ldflags=link_flags, build_directory=str(work),
        is_python_module=False, verbose=verbose,
    )
    return work / f"{NAME}.so"


def build(verbose: bool = False) -> Path:
    """Compile the kernels unless a build of these sources exists; returns the shared library.
    Raises ``BuildError`` with the reason where they cannot be built here."""
    directory = build_dir()
    library = _library(directory)
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)  # ninja from the venv, if installed there
    if bin_dir not in env.get("PATH", "").split(os.pathsep):
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    with open(directory / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process's build of the CPU kernels (%s)", directory)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():  # another process built it while this one waited
            return library
        compiler = env.get("CXX", "c++")
        if shutil.which(shlex.split(compiler)[0] if compiler.strip() else "", path=env["PATH"]) is None:
            raise BuildError(f"no C++ compiler: {compiler!r} is not on PATH (install g++ or clang, or set CXX)")
        if shutil.which("ninja", path=env["PATH"]) is None:
            raise BuildError("ninja is not installed (pip install ninja)")
        mismatch = _openmp_mismatch(compiler, env, openmp_runtime())
        if mismatch:
            raise BuildError(mismatch)
        work = directory / "work"
        work.mkdir(exist_ok=True)
        log_path = directory / "build.log"
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        command = [sys.executable, "-m", "kernels.cpu", "--compile", str(work)] + (["-v"] if verbose else [])
        logger.info("building the CPU kernels for this machine into %s (about a minute)", directory)
        with open(log_path, "w") as log:
            done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
        built = work / f"{NAME}.so"
        if done.returncode != 0 or not built.exists():
            raise BuildError(f"the C++ build failed: {_compiler_errors(log_path.read_text(errors='replace'))} "
                             f"(the whole log: {log_path})")
        if verbose:
            sys.stderr.write(log_path.read_text(errors="replace"))
        tmp = directory / f".{NAME}.so.tmp"
        shutil.copyfile(built, tmp)
        os.replace(tmp, library)
    return library


def load() -> object | None:
    """``torch.ops.kvserve_cpu`` with the kernels registered, or None if they cannot be built or
    loaded here (the reason in ``load_error()`` and logged once)."""
    with _lock:
        if "ops" in _state:
            return _state["ops"]
        ops = None
        try:
            if not hasattr(torch.ops.kvserve_cpu, "paged_attention"):  # never load the library twice
                torch.ops.load_library(str(build()))
            ops = torch.ops.kvserve_cpu
        except Exception as exc:  # no compiler, no ninja, a failed build: the torch kernels run instead
            text = str(exc).strip()
            reason = text if isinstance(exc, BuildError) else f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}"
            _state["error"] = reason
            logger.warning("compiled CPU kernels unavailable, the plain-torch kernels run instead: %s", reason)
        _state["ops"] = ops
        return ops


def load_error() -> str | None:
    """Why ``load()`` answered None (None if it has not failed)."""
    return _state.get("error")  # type: ignore[return-value]
