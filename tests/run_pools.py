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
pool of three equal workers, a fresh clone's suite took 20-23 minutes (the PP module alone 307 s of them).

Both runs' OpenMP threads sleep as soon as they wait (``OMP_WAIT_POLICY=PASSIVE`` unless set): by default
libgomp spins before it sleeps, and with two pytest-xdist workers of two threads each on 2 cores the
spinning threads took the cores from the ones with work. `tests/kernels/test_cpu_attention.py` and
`test_cpu_envelope.py` on two workers ran in 40 s spinning and 20 s passive alone, and in 190 s
against 38 s at nice 19 beside one busy loop (in the run before this setting one of their tests took
70 s where alone it takes 0.2 s).

Each run spreads its modules over pytest-xdist workers (`--dist loadfile`, the longest first:
tests/conftest.py); ``KVSERVE_CLUSTER_JOBS`` and ``KVSERVE_COMPUTE_JOBS`` (default 2 each) set how many.
Test paths on the command line go to the run they belong to (`python -m tests.run_pools -x
tests/kernels/test_cpu_moe.py` runs that file alone, niced); other arguments go to both. The compute
run refuses `ray.init` in its processes (tests/conftest.py), so a module that starts a cluster there
fails saying where it belongs. Both runs' output is prefixed with their name; the exit status is the
first failing run's (no test selected in one run is no failure); with `-x` or `--maxfail` a failing run
stops the other; each keeps its own `.pytest_cache/<run>`.
"""

from __future__ import annotations

import os
import signal
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


def pool_command(paths, jobs: int, durations: int, extra: list[str], name: str) -> list[str]:
    # each run its own cache (--lf / --ff read the failures of that run, not of whichever ended last)
    return [sys.executable, "-m", "pytest", "-q", "-n", str(jobs), "--dist", "loadfile",
            f"--durations={durations}", "-o", f"cache_dir=.pytest_cache/{name}", *extra, *paths]


def in_cluster_pool(path: Path) -> bool:
    return any(path == ROOT / p or (ROOT / p) in path.parents for p in CLUSTER_PATHS)


def split_args(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(options, cluster paths, compute paths): arguments naming test files, directories or node ids
    go to the pool they belong to (as absolute paths: the runs start in the repository's root), a
    directory holding both pools' modules (``tests``, ``.``) to both as the pools' own paths; the rest
    are options for both runs."""
    options, cluster, compute = [], [], []
    for arg in argv:
        path, sep, node = arg.partition("::")
        if arg.startswith("-") or not Path(path).exists():
            options.append(arg)
            continue
        resolved = Path(path).resolve()
        below = [p for p in CLUSTER_PATHS if resolved in (ROOT / p).parents]  # cluster directories inside it
        if below:  # a directory holding both pools' modules
            cluster += [str(ROOT / p) for p in below]
            compute += [str(ROOT / p) for p in compute_paths() if resolved in (ROOT / p).parents]
        else:
            (cluster if in_cluster_pool(resolved) else compute).append(str(resolved) + sep + node)
    return options, cluster, compute


def _relay(name: str, stream, sink, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            sink.write(f"[{name}] {line}")
            sink.flush()


def _stop(procs, grace_s: float) -> None:
    """Each run still going: waited for up to ``grace_s`` (a Ctrl-C reached it from the terminal and it
    is printing its summary), then terminated, then killed."""
    deadline = time.monotonic() + grace_s
    for _, proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.terminate()
    for _, proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str]) -> int:
    cluster_jobs = int(os.environ.get("KVSERVE_CLUSTER_JOBS", "2"))
    compute_jobs = int(os.environ.get("KVSERVE_COMPUTE_JOBS", "2"))
    options, cluster_paths, compute_paths_given = split_args(argv)
    if not (cluster_paths or compute_paths_given):  # no path named: the whole suite (else a pool named none not run)
        cluster_paths, compute_paths_given = list(CLUSTER_PATHS), compute_paths()
    pools = [("cluster", cluster_paths, cluster_jobs, [], 30),
             ("compute", compute_paths_given, compute_jobs, ["nice", "-n", "19"], 20)]
    pools = [pool for pool in pools if pool[1]]
    stop_at_first = any(o == "-x" or o.startswith(("--exitfirst", "--maxfail")) for o in options)
    lock = threading.Lock()
    started = time.monotonic()
    procs = []
    for name, paths, jobs, prefix, durations in pools:
        env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, POOL_ENV: name}
        procs.append((name, subprocess.Popen([*prefix, *pool_command(paths, jobs, durations, options, name)],
                                             cwd=ROOT, env=env, text=True, errors="replace", bufsize=1,
                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
    relays = [threading.Thread(target=_relay, args=(name, proc.stdout, sys.stdout, lock), daemon=True)
              for name, proc in procs]
    for relay in relays:
        relay.start()
    # SIGTERM (a CI job cancelled): passed on to both runs, which end as pytest ends on it
    signal.signal(signal.SIGTERM, lambda *_: [proc.terminate() for _, proc in procs])
    ended = {}
    try:
        while len(ended) < len(procs):
            for name, proc in procs:
                if name not in ended and proc.poll() is not None:
                    ended[name] = (proc.returncode, time.monotonic() - started)
                    if proc.returncode not in (0, 5) and stop_at_first:  # -x: the other run stops too
                        for _, other in procs:
                            if other.poll() is None:
                                other.terminate()
            time.sleep(0.5)
    except KeyboardInterrupt:
        _stop(procs, grace_s=20)
        for relay in relays:
            relay.join(timeout=5)
        return 130
    for relay in relays:
        relay.join(timeout=5)
    for name, _ in procs:
        print(f"[{name}] pytest exited {ended[name][0]} after {ended[name][1] / 60:.1f} min", flush=True)
    codes = [ended[name][0] for name, _ in procs]
    # 5 (no test selected) from one run is no failure where the other ran tests
    failed = [c for c in codes if c not in (0, 5)]
    return failed[0] if failed else (5 if codes and all(c == 5 for c in codes) else 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
