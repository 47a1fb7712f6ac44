"""`python -m tests.run_pools [PYTEST ARGS]`: the suite in two pytest runs at once (what `make test` runs).

- **cluster** (`tests/cluster`, `tests/serve`, `tests/benchmarks`): tests whose processes wait on each
  other (Ray rank actors stepping in turn, Serve's proxy, replicas and scheduler actor, servers and
  their clients), at the usual priority.
- **compute** (everything else: kernels, engine, workers, end-to-end in one process), at nice 19: it
  takes whatever CPU the cluster run leaves.

Why: such a chain of processes makes each hand-off wait for a core, and the Linux scheduler (EEVDF,
6.6 on) gives a woken process no head start over a process that computes without pause. On the 2-core
VM `tests/cluster/test_pipeline_parallel.py` ran in 53 s alone, in 418 s and in over 900 s beside two
busy loops of equal priority, in 137 s beside two at nice 10 and in 62 s beside two at nice 19. With one
pool of equal workers, a fresh clone's suite spent 22-23 minutes (the PP module alone 307 s of them).

Both runs' OpenMP threads sleep as soon as they wait (``OMP_WAIT_POLICY=PASSIVE`` unless set): by default
libgomp spins before it sleeps, and with two pytest-xdist workers of two threads each on 2 cores the
spinning threads took the cores from the ones with work. `tests/kernels/test_cpu_attention.py` and
`test_cpu_envelope.py` on two workers ran in 40 s spinning and 20 s passive alone, and in 190 s
against 38 s at nice 19 beside one busy loop (in the run before this setting one of their tests took
70 s where alone it takes 0.2 s).

Each run spreads its modules over pytest-xdist workers (`--dist loadfile`, the longest first:
tests/conftest.py); ``KVSERVE_CLUSTER_JOBS`` and ``KVSERVE_COMPUTE_JOBS`` (default 2 each) set how many.
The compute run refuses to start Ray (tests/conftest.py), so a module that needs a cluster cannot sit
in the pool that is niced. Both runs' output is prefixed with their name; the exit status is the first
non-zero of the two.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_PATHS = ("tests/cluster", "tests/serve", "tests/benchmarks")
POOL_ENV = "KVSERVE_TEST_POOL"


def compute_paths() -> list[str]:
    """Every test directory and top-level test module of tests/ outside the cluster pool."""
    tests = ROOT / "tests"
    paths = []
    for entry in sorted(tests.iterdir()):
        rel = entry.relative_to(ROOT).as_posix()
        if rel in CLUSTER_PATHS or entry.name.startswith((".", "_")):
            continue
        if entry.is_dir() and any(entry.rglob("test_*.py")):
            paths.append(rel)
        elif entry.is_file() and entry.name.startswith("test_") and entry.suffix == ".py":
            paths.append(rel)
    return paths


def pool_command(paths, jobs: int, durations: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-n", str(jobs), "--dist", "loadfile",
            f"--durations={durations}", *extra, *paths]


def _relay(name: str, stream, sink, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            sink.write(f"[{name}] {line}")
            sink.flush()


def main(argv: list[str]) -> int:
    cluster_jobs = int(os.environ.get("KVSERVE_CLUSTER_JOBS", "2"))
    compute_jobs = int(os.environ.get("KVSERVE_COMPUTE_JOBS", "2"))
    pools = [("cluster", list(CLUSTER_PATHS), cluster_jobs, 0, 30), ("compute", compute_paths(), compute_jobs, 19, 20)]
    lock = threading.Lock()
    started = time.monotonic()
    procs, relays = [], []
    for name, paths, jobs, nice, durations in pools:
        env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, POOL_ENV: name}
        proc = subprocess.Popen(pool_command(paths, jobs, durations, argv), cwd=ROOT, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=1,
                                preexec_fn=(lambda n=nice: os.nice(n)) if nice else None)
        relay = threading.Thread(target=_relay, args=(name, proc.stdout, sys.stdout, lock), daemon=True)
        relay.start()
        procs.append((name, proc))
        relays.append(relay)
    ended = {}
    try:
        while len(ended) < len(procs):
            for name, proc in procs:
                if name not in ended and proc.poll() is not None:
                    ended[name] = (proc.returncode, time.monotonic() - started)
            time.sleep(0.5)
    except KeyboardInterrupt:
        for _, proc in procs:
            proc.terminate()
        raise
    for relay in relays:
        relay.join(timeout=5)
    for name, _ in procs:
        print(f"[{name}] pytest exited {ended[name][0]} after {ended[name][1] / 60:.1f} min", flush=True)
    return next((ended[name][0] for name, _ in procs if ended[name][0] != 0), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
