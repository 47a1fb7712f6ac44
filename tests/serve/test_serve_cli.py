"""infra/serve_config.yaml through Serve's own command line: `serve run` (a local cluster) and
`serve deploy` (onto a running cluster). The config is used as shipped, with the model, the
ports and the cluster's address pointed at this test's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from benchmarks.server_process import pids_naming, stat, with_descendants
from cluster.serve_env import NODE_ENV
from tests.serve.serve_harness import free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
SERVE = str(Path(sys.executable).with_name("serve"))
RAY = str(Path(sys.executable).with_name("ray"))


def config_for(model_dir: str, tmp_path: Path, **args) -> tuple[Path, str]:
    config = yaml.safe_load((ROOT / "infra" / "serve_config.yaml").read_text())
    http_port = free_port()
    config["http_options"]["port"] = http_port
    config["grpc_options"]["port"] = free_port()
    config["applications"][0]["args"].update(model=model_dir, served_model_name="tiny", num_kv_blocks=256, **args)
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, f"http://127.0.0.1:{http_port}"


def completes(base_url: str) -> bool:
    try:
        r = httpx.post(f"{base_url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3},
                       timeout=10)
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def env() -> dict[str, str]:
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}


def test_serve_run_with_the_shipped_config(hf_cache, tmp_path):
    """`serve run` starts its own Ray with the CPUs this machine has (no logical CPUs added): at
    tensor_parallel_size 2 on a two-core machine the ranks take a CPU each and the rest none. The
    model is a Hugging Face repo id, which the Ingress, the scheduler actor and every rank find in the
    node's hub cache (offline). (`serve run` of a config with a model directory at
    tensor_parallel_size 1 is started by tests/benchmarks/test_online_vllm.py.)"""
    hub = {"HF_HUB_CACHE": hf_cache["cache"], "HF_HUB_OFFLINE": "1"}
    path, base_url = config_for(hf_cache["repo_id"], tmp_path, tensor_parallel_size=2)
    proc = subprocess.Popen([SERVE, "run", str(path)], cwd=ROOT, env={**env(), "RAY_ADDRESS": "local", **hub},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: proc.poll() is not None or completes(base_url), timeout_s=180, interval_s=1)
        assert proc.poll() is None, "serve run exited"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # `serve run` in the background ignores SIGINT
        proc.wait(timeout=60)


def test_serve_run_that_cannot_fit_stops_at_once_naming_the_setting(model_dirs):
    """The README's form, `serve run serve_app:app key=value ...`, asking for more CPUs than this
    machine has: it exits within 30 s, before any cluster starts, and says which setting to lower."""
    from ray._private.utils import get_num_cpus

    too_many = int(get_num_cpus()) + 1
    started = time.monotonic()
    result = subprocess.run([SERVE, "run", "serve_app:app", f"model={model_dirs['llama']}",
                             f"tensor_parallel_size={too_many}"], cwd=ROOT, env={**env(), "RAY_ADDRESS": "local"},
                            capture_output=True, text=True, timeout=60)
    assert time.monotonic() - started < 30
    assert result.returncode != 0
    assert (f"tensor_parallel_size={too_many} with engine_cpus=1 per rank needs {too_many} CPUs for one engine "
            f"but the largest node has {too_many - 1}: lower tensor_parallel_size") in result.stderr


def test_serve_deploy_onto_a_running_cluster(model_dirs, tmp_path):
    path, base_url = config_for(model_dirs["llama"], tmp_path)
    dashboard = free_port()
    temp_dir = tempfile.mkdtemp(prefix="kvray", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    gcs_port = free_port()
    started = subprocess.run([RAY, "start", "--head", "--num-cpus=4", f"--port={gcs_port}",
                              "--include-dashboard=true", f"--dashboard-port={dashboard}", f"--temp-dir={temp_dir}"],
                             cwd=ROOT, env={**NODE_ENV, **env()}, capture_output=True, text=True, timeout=180)
    assert started.returncode == 0, started.stderr[-2000:]
    try:
        subprocess.run([SERVE, "deploy", str(path), "--address", f"http://127.0.0.1:{dashboard}"],
                       cwd=ROOT, env=env(), check=True, capture_output=True, timeout=120)
        wait_for(lambda: completes(base_url), timeout_s=180, interval_s=1)
    finally:
        stop_cluster(temp_dir, gcs_port=gcs_port)


def stop_cluster(temp_dir: str, gcs_port: int | None = None) -> None:
    """Stop the cluster started with ``temp_dir`` alone: its processes name it on their command lines,
    and their children (the dashboard and runtime-env agents, whose titles do not) descend from them;
    ``gcs_port``: a head's, which its Ray client server names instead (`ray start` leaves it to init).
    (`ray stop` would stop every Ray process on the machine: the other test worker's clusters too.)"""
    def named() -> list[int]:
        return pids_naming(temp_dir) + (pids_naming(f":{gcs_port}\0") if gcs_port is not None else [])

    tree = with_descendants(named())

    def alive() -> list[int]:
        return [pid for pid in set(with_descendants(named()) + tree)
                if (st := stat(pid)) is not None and st[0] != "Z"]  # (a zombie is gone, its parent not yet told)

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in alive():
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + 30
        while alive() and time.monotonic() < deadline:
            time.sleep(0.5)
    assert alive() == []
