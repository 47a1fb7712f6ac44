"""The processes of a benchmarked server (Linux /proc): launching it in a session of its own with a tag in
its environment, waiting until it answers, reading the CPU seconds of every process it made (Ray's
workers are started by the raylet, not by the launched process: the tag finds them), and stopping it
with nothing left behind."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field

import httpx

TAG = "KVSERVE_BENCH_ONLINE_TAG"  # in every server process's environment: how its processes are found
LINGER_S = 15.0  # how long a server's other processes may take to exit after it did, before they are killed


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    url: str
    tag: str
    log_path: str
    launched: float
    ready_s: float | None = None
    extra: dict = field(default_factory=dict)


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def launch(name: str, command: list[str], env: dict[str, str], cwd: str, log_dir: str, port: int) -> Server:
    if not port_free(port):
        raise RuntimeError(f"port {port} is in use: stop whatever listens there, or pick another port for {name}")
    tag = uuid.uuid4().hex
    log_path = os.path.join(log_dir, f"{name}.log")
    log = open(log_path, "w")
    print(f"[{name}] {shlex.join(command)}  (log: {log_path})", flush=True)
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd,
                            env={**env, TAG: tag}, start_new_session=True)
    log.close()
    return Server(name, proc, f"http://127.0.0.1:{port}", tag, log_path, time.perf_counter())


def wait_ready(server: Server, served_name: str, timeout_s: float) -> None:
    """Until GET /v1/models lists the served model (no completion is sent: neither server is warmed)."""
    deadline = server.launched + timeout_s
    while time.perf_counter() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode} before answering:\n"
                               + tail(server.log_path))
        try:
            response = httpx.get(f"{server.url}/v1/models", timeout=5)
            if response.status_code == 200 and any(m.get("id") == served_name
                                                   for m in response.json().get("data", ())):
                server.ready_s = time.perf_counter() - server.launched
                print(f"[{server.name}] answering after {server.ready_s:.1f} s", flush=True)
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{server.name} did not answer within {timeout_s:.0f} s:\n" + tail(server.log_path))


# --- the processes of a server and their CPU time (Linux /proc) ---------------------------------------

def stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat fields after the command name (field 3, the state, is index 0)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def all_pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()] if os.path.isdir("/proc") else []


def _pids_whose(entry: str, test) -> list[int]:
    """The processes whose ``/proc/<pid>/<entry>`` (its bytes) passes ``test``; those gone meanwhile
    or unreadable are left out."""
    pids = []
    for pid in all_pids():
        try:
            with open(f"/proc/{pid}/{entry}", "rb") as f:
                if test(f.read()):
                    pids.append(pid)
        except OSError:
            continue
    return pids


def tagged_pids(tag: str) -> list[int]:
    needle = f"{TAG}={tag}".encode()
    return _pids_whose("environ", lambda environ: needle in environ.split(b"\0"))


def pids_naming(text: str) -> list[int]:
    """The processes whose command line contains ``text`` (e.g. a Ray cluster's own temp directory,
    which its GCS, raylet and workers are started with)."""
    needle = text.encode()
    return _pids_whose("cmdline", lambda cmdline: needle in cmdline)


def _stats() -> dict[int, list[str]]:
    """pid -> /proc/<pid>/stat fields of every live process."""
    return {pid: st for pid in all_pids() if (st := stat(pid)) is not None}


def _descendants(roots: list[int], stats: dict[int, list[str]]) -> set[int]:
    """``roots`` and every process in ``stats`` descending from them."""
    children: dict[int, list[int]] = {}
    for pid, st in stats.items():
        children.setdefault(int(st[1]), []).append(pid)
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, ()))
    return found


def with_descendants(pids: list[int]) -> list[int]:
    """``pids`` and every process descending from them, now (a process whose parent dies is handed to
    init, and its ancestry is lost: take the tree before stopping any of it)."""
    return sorted(_descendants(pids, _stats()))


def server_pids(server: Server) -> dict[int, str]:
    """pid -> start time of every process of the server: the launched process, its descendants, and
    whatever carries the server's tag in its environment (Ray's workers, started by the raylet)."""
    stats = _stats()
    found = _descendants([server.proc.pid, *tagged_pids(server.tag)], stats)
    return {pid: stats[pid][19] for pid in found if pid in stats}


def process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "?"
    if not args:
        return "?"
    if len(args) == 1 and " " in args[0]:  # a process title set as one string (Ray's workers)
        args = args[0].split()
    first = os.path.basename(args[0])
    if first.startswith("python") and len(args) > 1:
        rest = args[1:]
        while rest and rest[0].startswith("-") and rest[0] != "-m":
            rest = rest[1:]  # interpreter options (-u, -I, ...)
        if rest[:1] == ["-m"] and len(rest) > 1:
            return rest[1][:60]
        return " ".join([os.path.basename(rest[0]), *rest[1:2]])[:60] if rest else first
    return first[:60]


def cpu_seconds(pids) -> dict[int, tuple[str, float]]:
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        fields = stat(pid)
        if fields is not None:
            out[pid] = (process_name(pid), (int(fields[11]) + int(fields[12])) / ticks)
    return out


def cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds spent between two samples, summed by process name, largest first."""
    by_name: dict[str, float] = {}
    for pid, (name, seconds) in after.items():
        spent = seconds - (before[pid][1] if pid in before else 0.0)
        by_name[name] = by_name.get(name, 0.0) + spent
    return dict(sorted(((k, round(v, 2)) for k, v in by_name.items() if v > 0), key=lambda kv: -kv[1]))


def stop(server: Server, grace_s: float = 60.0) -> list[str]:
    """SIGTERM, wait, then SIGKILL to its process group; then kill any process of the server that
    outlived it (a Ray cluster's raylet and workers). Returns what had to be killed."""
    pids = server_pids(server)
    killed = []
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            killed.append(f"{server.name} (pid {server.proc.pid}) after {grace_s:.0f} s")
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()

    def alive() -> list[int]:
        same = [pid for pid, start in pids.items() if (st := stat(pid)) is not None and st[19] == start
                and st[0] != "Z"]
        return sorted(set(same) | set(tagged_pids(server.tag)))

    deadline = time.monotonic() + LINGER_S
    while (left := alive()) and time.monotonic() < deadline:
        time.sleep(1.0)
    for pid in left:
        killed.append(f"{process_name(pid)} (pid {pid})")
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + 10
    while left and alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    return killed
