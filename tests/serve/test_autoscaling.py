"""Serve autoscaling with short delays: load scales the LLMServer deployment up (each new replica
brings its own engine in its own placement group) and idleness scales it back down."""

from __future__ import annotations

import concurrent.futures
import threading

import httpx
import pytest

from tests.serve.serve_harness import start_serve, stop_serve, wait_for

APP = "autoscale"


@pytest.fixture(scope="module")
def cluster():
    # replicas and handles report their load every second (Serve's default is slower); the
    # processes Ray starts inherit this environment
    # (and build_app, which tells Serve the interval its window is checked against)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")
        env.setenv("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")
        base_url, _ = start_serve(num_cpus=8)
        yield base_url
        stop_serve()


def running_replicas() -> int:
    from ray import serve

    status = serve.status().applications[APP].deployments["LLMServer"]
    return status.replica_states.get("RUNNING", 0)


def test_scales_up_under_load_and_back_down(cluster, model_dirs):
    from ray import serve

    from serve_app import build_app

    args = {"model": model_dirs["llama"], "served_model_name": "tiny", "min_replicas": 1, "max_replicas": 2,
            "target_ongoing_requests": 1, "upscale_delay_s": 0.5, "downscale_delay_s": 2.0, "look_back_period_s": 3.0,
            "num_kv_blocks": 512, "max_num_seqs": 16}
    serve.run(build_app(args), name=APP, route_prefix="/")
    assert running_replicas() == 1

    scaled_up = threading.Event()

    def client(i: int) -> list[int]:
        """Requests one after another until the second replica runs (the engine is fast enough that
        a fixed number of requests can finish before the autoscaler looks)."""
        codes = []
        while not scaled_up.is_set():
            body = {"model": "tiny", "prompt": f"load {i}", "max_tokens": 600, "ignore_eos": True}
            codes.append(httpx.post(f"{cluster}/v1/completions", json=body, timeout=300).status_code)
        return codes

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        load = [pool.submit(client, i) for i in range(8)]  # 8 in flight
        try:
            wait_for(lambda: running_replicas() == 2, timeout_s=90)
        finally:
            scaled_up.set()
        codes = [code for f in load for code in f.result()]
        assert codes and set(codes) == {200}
    wait_for(lambda: running_replicas() == 1, timeout_s=90)
    serve.delete(APP)
