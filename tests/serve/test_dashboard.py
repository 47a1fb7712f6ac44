"""/dashboard and /dashboard/data through the app (api/http_app.py, api/dashboard.py) over a real
engine: the key, the documented fields, counts that agree with /metrics (idle, and with requests held
in flight), the history, and the parameters that keep a poll small."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from api.dashboard import CONTENT_SECURITY_POLICY, kv_map_body
from engine.kv_map import STATES, rle_decode
from tests.serve.dashboard_harness import (AUTH, assert_counts_match_metrics, dash_app, dashboard_app,  # noqa: F401
                                           engine_paused, monitor, requests_in_flight)
from tests.serve.openai_harness import (API_KEY, MODEL, REPLICA, assert_error, llm, model_dir, prompts,  # noqa: F401
                                        run, until_clean)

REPLICA_FIELDS = {"replica", "time", "block_size", "num_blocks", "counts", "grid", "grid_id", "num_requests_running",
                  "num_requests_waiting", "kv_cache_usage", "prefix_cache_queries", "prefix_cache_hits",
                  "prefix_cache_hit_rate", "host_tier", "shared_prefixes", "history"}


def client(app, **kwargs) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", **kwargs)


def test_the_page_loads_without_the_key_and_needs_nothing_from_elsewhere(dash_app, llm, model_dir, monitor, run):
    async def main():
        async with client(dash_app) as http:
            guarded = await http.get("/dashboard")
        async with client(dashboard_app(llm, model_dir, monitor, api_key=None)) as http:
            open_page = await http.get("/dashboard")
        return guarded, open_page

    guarded, open_page = run(main())
    assert guarded.status_code == 200 and guarded.headers["content-type"].startswith("text/html")
    assert guarded.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert 'data-auth-required="true"' in guarded.text and 'data-auth-required="false"' in open_page.text
    html = guarded.text
    assert API_KEY not in html
    # every src/href is inline data; the only URL is the SVG namespace, which is a name, never fetched
    assert re.findall(r'(?:src|href)="([^"]*)"', html) == ["data:,"]
    assert set(re.findall(r"https?://[^\s\"')]+", html)) == {"http://www.w3.org/2000/svg"}
    assert "url(" not in html and "@import" not in html


def test_the_data_needs_the_key(dash_app, run):
    async def main():
        async with client(dash_app) as http:
            return [await http.get("/dashboard/data", headers=h) for h in
                    ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, AUTH)]

    missing, wrong, not_bearer, good = run(main())
    for response in (missing, wrong, not_bearer):
        error = assert_error(response, 401)
        assert error["code"] == "invalid_api_key"
    assert good.status_code == 200 and good.json()["object"] == "kv_map"


def test_the_app_without_a_map_has_no_dashboard(llm, model_dir, run):
    from api.http_app import build_openai_app

    app = build_openai_app(lambda: None, api_key=None)

    async def main():
        async with client(app) as http:
            return (await http.get("/dashboard")).status_code, (await http.get("/dashboard/data")).status_code

    assert run(main()) == (404, 404)


def test_idle_counts_match_metrics_and_the_pool(dash_app, llm, prompts, monitor, run):
    """After known requests (two sharing 300 prompt tokens) the engine is idle: nothing held, every
    full block cached, and the map agrees with /metrics and the engine's own stats."""
    async def main():
        async with client(dash_app, headers=AUTH) as http:
            for prompt in (prompts[3], prompts[4], prompts[6]):
                response = await http.post("/v1/completions", json={
                    "model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True})
                assert response.status_code == 200, response.text
            await until_clean(llm)
            data = (await http.get("/dashboard/data")).json()
            metrics = (await http.get("/metrics")).text
            return data, metrics

    data, metrics = run(main())
    assert set(data) == {"object", "time", "poll_interval_s", "replicas"} and data["poll_interval_s"] == 1.5
    (replica,) = data["replicas"]
    assert set(replica) == REPLICA_FIELDS and replica["replica"] == REPLICA
    stats = llm.stats()
    assert replica["num_blocks"] == stats["num_kv_blocks"] - 1 and replica["block_size"] == stats["block_size"]
    states = rle_decode(replica["grid"])
    assert {name: states.count(code) for code, name in STATES.items()} == replica["counts"]
    assert replica["counts"]["used"] == replica["counts"]["shared"] == 0
    assert replica["counts"]["cached"] == stats["num_cached_blocks"] > 0
    assert replica["prefix_cache_hits"] == stats["prefix_cache_hits"] > 0
    assert replica["shared_prefixes"] == []
    assert_counts_match_metrics(replica, metrics)


def test_counts_match_metrics_with_requests_in_flight(dash_app, llm, prompts, monitor, run):
    """Three requests held running, two of them (and a third built the same way) sharing 300 prompt
    tokens: the map shows the shared blocks and the prefix they form, and agrees with /metrics read
    while the engine stands between two steps."""
    shared = prompts[3][:300]
    in_flight = [prompts[3], prompts[4], shared + prompts[2][:25]]

    async def main():
        async with client(dash_app, headers=AUTH) as http:
            async with requests_in_flight(llm, in_flight, max_tokens=1500):
                async with engine_paused(llm):
                    data = (await http.get("/dashboard/data", params={"since": 0})).json()
                    metrics = (await http.get("/metrics")).text
                    fresh = monitor.snapshot()
            await until_clean(llm)
        return data, metrics, fresh

    data, metrics, fresh = run(main())
    (replica,) = data["replicas"]
    assert replica["counts"] == fresh["counts"] and replica["grid"] == fresh["grid"]  # the pool stood still
    counts = replica["counts"]
    assert counts["shared"] >= 300 // 16 and counts["used"] >= 3 and replica["num_requests_running"] == 3
    block_size = replica["block_size"]
    top = replica["shared_prefixes"][0]
    assert top["requests"] == 3 and top["blocks"] == 300 // block_size and top["tokens"] == top["blocks"] * block_size
    assert_counts_match_metrics(replica, metrics)


def test_history_since_known_grids_and_compression(dash_app, llm, monitor, run):
    """The history is served whole, then only what is newer than ``since``; a grid the viewer holds
    comes back null; a large body is gzip-compressed for a client that accepts it."""
    async def main():
        while len(monitor.history) < 3:  # sampled every 0.5 s since the module started
            await asyncio.sleep(0.05)
        async with client(dash_app, headers=AUTH) as http:
            whole = (await http.get("/dashboard/data")).json()["replicas"][0]
            last_t = whole["history"]["t"][-1]
            later = (await http.get("/dashboard/data", params={"since": last_t, "known": whole["grid_id"]})).json()
            raw = await http.get("/dashboard/data", headers={"Accept-Encoding": "gzip"})
            plain = await http.get("/dashboard/data", headers={"Accept-Encoding": "identity"})
            return whole, later["replicas"][0], raw, plain

    whole, later, raw, plain = run(main())
    history = whole["history"]
    assert history["period_s"] == 0.5 and history["window_s"] == 10.0
    assert len(history["t"]) >= 3 and history["t"] == sorted(history["t"])
    assert {len(v) for k, v in history.items() if isinstance(v, list)} == {len(history["t"])}
    assert all(t > history["t"][-1] for t in later["history"]["t"])
    assert later["grid"] is None and later["grid_id"] == whole["grid_id"] and later["counts"] == whole["counts"]
    assert plain.headers.get("content-encoding") is None
    body = len(plain.content)
    assert raw.headers.get("content-encoding") == ("gzip" if body >= 1024 else None)
    assert raw.json()["replicas"][0]["grid"] == whole["grid"]


def test_bad_parameters_get_a_400_naming_them(dash_app, run):
    async def main():
        async with client(dash_app, headers=AUTH) as http:
            return [await http.get("/dashboard/data", params=p) for p in
                    ({"since": "soon"}, {"since": "nan"}, {"known": "a,b;c"}, {"known": ",".join(["a"] * 65)})]

    since_text, since_nan, known_bad, known_many = run(main())
    assert_error(since_text, 400, "since")
    assert_error(since_nan, 400, "since")
    assert "grid ids" in assert_error(known_bad, 400, "known")["message"]
    assert_error(known_many, 400, "known")


def test_the_body_keeps_each_replica_apart():
    """Replicas sorted by name, each with its own grid dropped when known and history cut at since."""
    def snapshot(grid_id, times):
        return {"grid": "f3", "grid_id": grid_id, "history": {"period_s": 1.0, "t": times, "kv_usage": [0.0] * len(times)}}

    body = kv_map_body({"b": snapshot("g2", [1.0, 2.0, 3.0]), "a": snapshot("g1", [2.5])}, since=2.0,
                       known=frozenset({"g2"}), now=10.0)
    assert body["time"] == 10.0 and [r["replica"] for r in body["replicas"]] == ["a", "b"]
    a, b = body["replicas"]
    assert (a["grid"], b["grid"]) == ("f3", None)
    assert a["history"]["t"] == [2.5] and b["history"] == {"period_s": 1.0, "t": [3.0], "kv_usage": [0.0]}
    assert json.loads(json.dumps(body)) == body  # plain JSON
