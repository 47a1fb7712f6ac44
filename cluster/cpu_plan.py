"""The engine's CPU threads on a CPU node, when nobody chose them: how many, and which cores.

How many (``default_threads``): the engine's share of the node's physical cores. The share is what
the engine reserves plus what its serving actors (Serve's proxy, the Ingress, the LLMServer replica)
reserve beside it, over the node's logical CPUs; on a node of up to ``SMALL_NODE_CORES`` physical
cores the engine runs a thread on every core of that share, the serving actors taking their turns
between its steps (on 2 cores, under vLLM's serving client on the shared-prefix workload at
concurrency 48, 2 threads gave 1.37x the output tok/s of 1: 322 against about 236); above, it leaves them
``SERVING_CORES`` core, so that a step's threads do not wait on a core the proxy holds (an OpenMP
region runs as fast as its slowest thread).

Which cores (``bind_engine_threads``): one logical CPU per physical core, on one socket where they
fit, that no other engine on this node has claimed. Claims live in a small file per node
(``claims_path``), under a lock, keyed by process id, and a dead process's claim is dropped: a second
replica on the same node takes other cores, or, when none are left, runs unbound (a replica that
starts while the one it replaces still runs, on a node whose cores that one holds, runs unbound for
its life). Binding needs Linux and the compiled kernels (their ``bind_threads`` op sets each OpenMP
thread's affinity); without them, or with more threads than physical cores, the engine runs unbound
and says why. Off Linux the node's CPUs are ``os.cpu_count()``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

SMALL_NODE_CORES = 4  # up to this many physical cores, the engine's threads take them all
SERVING_CORES = 1  # cores left to the serving actors on larger nodes


def cpu_topology(cpus: set[int] | None = None) -> dict[int, tuple[int, int]]:
    """Logical CPU -> (socket, physical core) for ``cpus`` (default: those this process may run on),
    from /sys; a CPU whose topology is unreadable counts as a core of its own."""
    if cpus is None:
        cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    topology = {}
    for cpu in sorted(cpus):
        base = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            topology[cpu] = (int((base / "physical_package_id").read_text()), int((base / "core_id").read_text()))
        except (OSError, ValueError):
            topology[cpu] = (-1, -1 - cpu)
    return topology


def physical_cores(topology: dict[int, tuple[int, int]]) -> int:
    return len(set(topology.values()))


def default_threads(reserved_cpus: float, node_cpus: float, cores: int) -> int:
    """Intra-op threads for an engine that reserves ``reserved_cpus`` (its own and its serving actors')
    of a node of ``node_cpus`` logical CPUs and ``cores`` physical cores."""
    share = cores * min(1.0, reserved_cpus / node_cpus) if node_cpus > 0 else 1
    threads = max(1, round(share))
    if cores > SMALL_NODE_CORES:
        threads = max(1, threads - SERVING_CORES)
    return threads


def claims_path() -> Path:
    return Path("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()) / f"kvserve-cores-{os.getuid()}.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def choose_cores(count: int, topology: dict[int, tuple[int, int]], taken: set[int]) -> list[int] | None:
    """``count`` logical CPUs, one per physical core, none of a core in ``taken`` (logical CPUs), all on
    the socket with the most free cores where they fit; None where fewer than ``count`` are free."""
    taken_cores = {topology[c] for c in taken if c in topology}
    first: dict[tuple[int, int], int] = {}
    for cpu, core in sorted(topology.items()):
        if core not in taken_cores:
            first.setdefault(core, cpu)
    if len(first) < count:
        return None
    by_socket: dict[int, list[int]] = {}
    for core, cpu in sorted(first.items()):
        by_socket.setdefault(core[0], []).append(cpu)
    sockets = sorted(by_socket.values(), key=len, reverse=True)
    if len(sockets[0]) >= count:
        return sorted(sockets[0][:count])
    return sorted(cpu for socket in sockets for cpu in socket)[:count]


def claim_cores(count: int, topology: dict[int, tuple[int, int]], pid: int | None = None,
                path: Path | None = None) -> list[int] | None:
    """Claim ``count`` cores for process ``pid`` (default: this one) in the node's claims file; None
    where not enough are free. Claims of dead processes are dropped."""
    import fcntl  # (POSIX; binding is Linux-only anyway)

    pid = os.getpid() if pid is None else pid
    path = claims_path() if path is None else path
    with open(f"{path}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            claims = {int(k): v for k, v in json.loads(path.read_text()).items()}
        except (OSError, ValueError):
            claims = {}
        claims = {p: cores for p, cores in claims.items() if p != pid and _alive(p)}
        taken = {c for cores in claims.values() for c in cores}
        cores = choose_cores(count, topology, taken)
        if cores is not None:
            claims[pid] = cores
        path.write_text(json.dumps({str(p): c for p, c in claims.items()}))
    return cores


def bind_engine_threads(threads: int, ops=None, topology: dict[int, tuple[int, int]] | None = None
                        ) -> tuple[list[int], str]:
    """Bind the calling thread's parallel regions (``threads`` threads: torch.set_num_threads first) to
    claimed cores. Returns (the cores, '') or ([], why they stay unbound). Call it on the thread that
    runs the engine's steps: OpenMP keeps one team of threads per calling thread. ``topology``: the
    node's (``cpu_topology()``), where the caller has read it already."""
    if not sys.platform.startswith("linux"):
        return [], "not bound: binding threads to cores is implemented on Linux only"
    try:
        if ops is None:
            from kernels.cpu import load, load_error

            ops = load()
            if ops is None:
                return [], f"not bound: the compiled kernels are unavailable ({load_error()})"
        topology = cpu_topology() if topology is None else topology
        if threads > physical_cores(topology):
            return [], f"not bound: {threads} threads are more than this node's {physical_cores(topology)} physical cores"
        cores = claim_cores(threads, topology)
        if cores is None:
            return [], f"not bound: fewer than {threads} cores of this node are free (other engines claimed them)"
        bound = list(ops.bind_threads(cores))
    except Exception as exc:  # noqa: BLE001 - binding is an optimisation: the engine runs unbound
        logger.warning("binding the engine's threads failed", exc_info=True)
        return [], f"not bound: {type(exc).__name__}"
    if bound != cores:
        return [c for c in bound if c >= 0], f"bound {sum(c >= 0 for c in bound)} of {threads} threads"
    return cores, ""
