"""A real Ray Serve deployment of kvserve for end-to-end tests: one local Ray cluster per module,
HTTP and gRPC proxies on free ports, helpers to read /metrics."""

from __future__ import annotations

import re
import time

import httpx

from cluster.serve_env import free_port

SERVICER = "api.kvserve_pb2_grpc.add_KVServeServicer_to_server"


def start_serve(num_cpus: int = 8) -> tuple[str, str]:
    """ray.init + serve.start with HTTP and gRPC on free ports: (http base url, grpc address)."""
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    http_port, grpc_port = free_port(), free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port},
                    grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[SERVICER]))
    except BaseException:
        ray.shutdown()  # else every later module of this test worker fails in ray.init ("called twice")
        raise
    return f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"


def stop_serve() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


# Serve stops a replica (serve.delete, a scale-down, an unhealthy replica replaced) only after a whole
# ``graceful_shutdown_wait_loop_s`` (2 s by default) even with nothing in flight, checking again every as
# long: the apps the tests start check every 0.1 s instead (the same drain, without the idle wait)
QUICK_STOP = {"graceful_shutdown_wait_loop_s": 0.1}


def quick_stop(**deployment_options) -> dict:
    """App arguments giving both deployments ``QUICK_STOP``, and the LLMServer ``deployment_options``."""
    return {"deployment_config": {**QUICK_STOP, **deployment_options}, "ingress_deployment_config": dict(QUICK_STOP)}


def metrics(base_url: str) -> dict[str, float]:
    """/metrics as {series: value}, summing over replicas; histogram series keep their suffix."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        match = re.match(r"([^{\s]+)(\{[^}]*\})?\s+(\S+)", line)
        name, labels, value = match.groups()
        if name.endswith("_bucket"):
            continue
        totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def wait_for(predicate, timeout_s: float = 60.0, interval_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        time.sleep(interval_s)
