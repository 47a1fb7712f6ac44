"""The KV-cache map on Ray Serve: the Ingress gathers one entry per engine replica from the scheduler
actors (each sampling its own history), under the replica names /metrics uses, behind the API key."""

from __future__ import annotations

import httpx
import pytest

from engine.kv_map import STATES, rle_decode
from tests.serve.openai_harness import parse_metrics
from tests.serve.serve_harness import start_serve, stop_serve, wait_for

API_KEY = "sk-dashboard"
MODEL = "tiny"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def served(model_dirs):
    from ray import serve

    from serve_app import build_app

    base_url, _ = start_serve()
    args = {"model": model_dirs["llama"], "served_model_name": MODEL, "api_key": API_KEY, "num_replicas": 2,
            "max_num_seqs": 4, "num_kv_blocks": 300, "engine_cpus": 1, "router": "pow2"}
    serve.run(build_app(args), name="kvserve", route_prefix="/")
    yield base_url
    stop_serve()


def kv_map(base_url: str, **params) -> dict:
    response = httpx.get(f"{base_url}/dashboard/data", headers=AUTH, params=params, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_page_is_open_and_the_data_needs_the_key(served):
    page = httpx.get(f"{served}/dashboard", timeout=30)
    assert page.status_code == 200 and 'data-auth-required="true"' in page.text
    refused = httpx.get(f"{served}/dashboard/data", timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


def test_one_entry_per_replica_matching_metrics(served):
    """Requests spread over both replicas, then idle: each replica's entry has its own pool, its own
    history sampled by its scheduler actor, and the numbers /metrics gives under the same name."""
    with httpx.Client(base_url=served, headers=AUTH, timeout=60) as http:
        for i in range(16):  # two replicas chosen at random: each gets some
            response = http.post("/v1/completions", json={
                "model": MODEL, "prompt": f"The river bends {i} times near the old mill by the road", "max_tokens": 4,
                "temperature": 0.0, "ignore_eos": True})
            assert response.status_code == 200, response.text

    def idle() -> dict | None:
        data = kv_map(served)
        quiet = all(r["num_requests_running"] == r["num_requests_waiting"] == 0 and
                    r["counts"]["used"] == r["counts"]["shared"] == 0 for r in data["replicas"])
        return data if quiet and len(data["replicas"]) == 2 else None

    data = wait_for(idle, timeout_s=60)
    metrics = parse_metrics(httpx.get(f"{served}/metrics", timeout=30).text)
    names = [r["replica"] for r in data["replicas"]]
    labelled = {dict(labels)["replica"] for (name, labels) in metrics["kvserve:kv_cache_usage_perc"][1]}
    assert names == sorted(labelled) and len(set(names)) == 2

    def gauge(name: str, replica: str, sample: str | None = None) -> float:
        return metrics[name][1][(sample or name, (("model_name", MODEL), ("replica", replica)))]

    def counter(name: str, replica: str) -> float:
        return gauge(name, replica, f"{name}_total")

    queries = 0
    for replica in data["replicas"]:
        name = replica["replica"]
        assert replica["num_blocks"] == 299
        states = rle_decode(replica["grid"])
        assert {n: states.count(code) for code, n in STATES.items()} == replica["counts"]
        assert gauge("kvserve:kv_cache_usage_perc", name) == 0.0
        assert gauge("kvserve:prefix_cache_hit_rate", name) == replica["prefix_cache_hit_rate"]
        assert counter("kvserve:prefix_cache_queries", name) == replica["prefix_cache_queries"]
        assert counter("kvserve:prefix_cache_hits", name) == replica["prefix_cache_hits"]
        assert replica["counts"]["cached"] > 0  # each replica served some of the requests
        queries += replica["prefix_cache_queries"]
    assert queries == sum(counter("kvserve:prompt_tokens", r) for r in names)


def test_each_actor_keeps_its_history(served):
    """A viewer arriving later still gets the samples each engine took before it came."""
    def sampled() -> dict | None:
        data = kv_map(served)
        return data if all(len(r["history"]["t"]) >= 3 for r in data["replicas"]) else None

    data = wait_for(sampled, timeout_s=30)
    for replica in data["replicas"]:
        history = replica["history"]
        assert history["period_s"] == 1.0 and history["t"] == sorted(history["t"])
        assert 0.5 < history["t"][-1] - history["t"][-2] < 3.0  # about one a second
        later = kv_map(served, since=history["t"][-1], known=replica["grid_id"])
        (again,) = [r for r in later["replicas"] if r["replica"] == replica["replica"]]
        assert all(t > history["t"][-1] for t in again["history"]["t"]) and again["grid"] is None
