"""Serve autoscaling with short delays: load scales the LLMServer deployment up (each new replica
brings its own engine in its own placement group) and idleness scales it back down."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from tests.serve.serve_harness import start_serve, stop_serve, wait_for

APP = "autoscale"


@pytest.fixture(scope="module")
def cluster():
    # replicas and handles report their load every second (Serve's default is slower); the
    # processes Ray starts inherit this environment
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
            "target_ongoing_requests": 1, "upscale_delay_s": 0.5, "downscale_delay_s": 2.0,
            "num_kv_blocks": 512, "max_num_seqs": 16}
    serve.run(build_app(args), name=APP, route_prefix="/")
    assert running_replicas() == 1

    def request(i: int) -> int:
        body = {"model": "tiny", "prompt": f"load {i}", "max_tokens": 600, "ignore_eos": True}
        return httpx.post(f"{cluster}/v1/completions", json=body, timeout=300).status_code

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        load = [pool.submit(request, i) for i in range(16)]  # 8 in flight, two waves
        wait_for(lambda: running_replicas() == 2, timeout_s=90)
        assert [f.result() for f in load] == [200] * 16
    wait_for(lambda: running_replicas() == 1, timeout_s=90)
    serve.delete(APP)
