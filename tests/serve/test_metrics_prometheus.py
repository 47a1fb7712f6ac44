"""/metrics as the ecosystem reads it: the exposition (api/metrics.py, prometheus_client) read back by
prometheus_client's parser with exact values after known requests and label values escaped, and a
real Prometheus (the `prometheus` binary, e.g. Debian's `apt-get install prometheus`) scraping the
OpenAI app served by uvicorn, with every panel query of infra/grafana/kvserve-dashboard.json answered
by data."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from api.metrics import HISTOGRAMS, cumulative_buckets, prometheus_text
from engine.metrics import LATENCY_BUCKETS, TOKEN_BUCKETS, Histogram, RequestStats
from tests.serve.openai_harness import (API_KEY, MODEL, REPLICA, app, llm, model_dir, parse_metrics,  # noqa: F401
                                        prompts, run, until_clean)
from tests.serve.serve_harness import free_port

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "infra" / "grafana" / "kvserve-dashboard.json"
PROMETHEUS_CONFIG = ROOT / "infra" / "grafana" / "prometheus.yml"
LABELS = (("model_name", MODEL), ("replica", REPLICA))
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def sample(families: dict, name: str, labels=LABELS, **extra: str) -> float:
    """The one sample ``name`` with ``labels`` (plus ``extra``) of a parsed exposition."""
    wanted = (name, tuple(sorted((*labels, *extra.items()))))
    found = [samples[wanted] for _, samples in families.values() if wanted in samples]
    assert len(found) == 1, f"{name} {extra}: {len(found)} samples"
    return found[0]


# --- the exposition alone ----------------------------------------------------------------------------


def test_label_values_are_escaped_and_histograms_cumulative():
    """Quotes, backslashes and newlines in the model name and replica come back intact through the
    parser; a histogram's per-bucket counts become Prometheus's cumulative buckets, +Inf last."""
    latency = Histogram()
    for value in (0.0005, 0.003, 0.003, 0.3, 70.0, 5000.0):  # 5000 s is past the last bound: +Inf
        latency.observe(value)
    stats = {"num_generation_tokens": 12, "kv_cache_usage": 0.25, "num_requests_running": 3,
             "histograms": {"e2e_request_latency_seconds": latency.as_dict()}}
    model, replicas = 'tiny "llama"\\ and\na newline', ['a"b', "c\\d", "e\nf"]
    families = parse_metrics(prometheus_text({r: stats for r in replicas}, model))
    for replica in replicas:
        labels = (("model_name", model), ("replica", replica))
        assert sample(families, "kvserve:generation_tokens_total", labels) == 12.0
        assert sample(families, "kvserve:kv_cache_usage_perc", labels) == 0.25
        assert sample(families, "kvserve:num_requests_running", labels) == 3.0
        e2e = "kvserve:e2e_request_latency_seconds"
        expected = {0.001: 1, 0.005: 3, 0.25: 3, 0.5: 4, 60.0: 4, 80.0: 5, 960.0: 5}
        for bound, cumulative in expected.items():
            assert sample(families, f"{e2e}_bucket", labels, le=str(bound)) == cumulative
        assert sample(families, f"{e2e}_bucket", labels, le="+Inf") == 6
        assert sample(families, f"{e2e}_count", labels) == 6
        assert sample(families, f"{e2e}_sum", labels) == pytest.approx(5070.3065)
    kinds = {name: kind for name, (kind, _) in families.items()}
    assert kinds["kvserve:generation_tokens"] == "counter" and kinds["kvserve:kv_cache_usage_perc"] == "gauge"
    assert all(kinds[f"kvserve:{name}"] == "histogram" for name in HISTOGRAMS)


def test_latency_buckets_reach_long_generations():
    assert max(LATENCY_BUCKETS) >= 120.0 and list(LATENCY_BUCKETS) == sorted(LATENCY_BUCKETS)
    assert cumulative_buckets(Histogram().as_dict())[-1] == ("+Inf", 0.0)


def test_request_stats_count_successes_only():
    """A sample that ended in an error is no success: neither counted by reason nor in the token
    histograms."""
    finished = RequestStats()
    finished.observe("length", 45, 5)
    finished.observe("stop", 70, 3)
    finished.observe("error", 9, 2)
    assert finished.finished == {"stop": 1, "length": 1, "abort": 0}
    assert finished.prompt_tokens.count == finished.generation_tokens.count == 2
    assert (finished.prompt_tokens.total, finished.generation_tokens.total) == (115, 8)
    assert finished.generation_tokens.counts[TOKEN_BUCKETS.index(5)] == 2  # 3 and 5 in (2, 5]


def test_a_histogram_without_its_inf_count_is_refused():
    broken = {"buckets": [0.1, 1.0], "counts": [1, 2], "sum": 0.5, "count": 3}
    with pytest.raises(ValueError, match="one count per bucket and one for \\+Inf, got 2 counts for 2 buckets"):
        prometheus_text({"0": {"histograms": {"e2e_request_latency_seconds": broken}}}, MODEL)


def test_the_engine_counts_each_sample_by_how_it_ended(model_dirs):
    """n = 3 samples to max_tokens end with "length" (three successes, 3 x 4 generated tokens); an
    aborted request counts once per sample as "abort"."""
    from engine import SamplingParams
    from tests.engine.test_engine_failures import FakeExecutor, make_core, run as run_core

    core = make_core(model_dirs, FakeExecutor())
    core.add_request("n3", [5, 6, 7, 8, 9], SamplingParams(n=3, temperature=0.0, max_tokens=4, ignore_eos=True))
    run_core(core)
    core.add_request("gone", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    core.step()
    core.abort_request("gone")
    stats = core.stats()
    assert stats["finished_requests"] == {"stop": 0, "length": 3, "abort": 1}
    generated, prompt = stats["histograms"]["request_generation_tokens"], stats["histograms"]["request_prompt_tokens"]
    assert generated["count"] == prompt["count"] == 4
    assert prompt["sum"] == 3 * 5 + 3
    assert generated["sum"] == 3 * 4 + 1  # the aborted request had its first token
    families = parse_metrics(prometheus_text({"0": stats}, "m"))
    labels = (("model_name", "m"), ("replica", "0"))
    assert sample(families, "kvserve:request_success_total", labels, finished_reason="length") == 3
    assert sample(families, "kvserve:request_success_total", labels, finished_reason="abort") == 1


# --- the engine's exposition after known requests ------------------------------------------------------


def test_known_requests_move_each_family_by_its_exact_amount(app, llm, prompts, run):
    """Three greedy completions of token-id prompts (one prompt twice): the token counters move by
    the exact token counts, each latency histogram by one observation per request (inter-token by one
    per token after the first), and the prefix cache by the full blocks of the repeated prompt."""
    first, second = list(reversed(prompts[6]))[:45], list(reversed(prompts[5]))[:70]  # seen nowhere else
    requests = [(first, 5), (second, 3), (first, 4)]

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     headers=AUTH) as http:
            before = (await http.get("/metrics")).text
            usages = []
            for prompt, max_tokens in requests:  # one after the other: the third finds the first's blocks
                response = await http.post("/v1/completions", json={
                    "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                    "ignore_eos": True})
                assert response.status_code == 200, response.text
                usages.append(response.json()["usage"])
            await until_clean(llm)
            return before, usages, (await http.get("/metrics")).text

    before_text, usages, after_text = run(main())
    before, after = parse_metrics(before_text), parse_metrics(after_text)
    block_size = llm.stats()["block_size"]

    def delta(name: str, **extra: str) -> float:
        return sample(after, name, **extra) - sample(before, name, **extra)

    assert [u["prompt_tokens"] for u in usages] == [45, 70, 45]
    assert [u["completion_tokens"] for u in usages] == [5, 3, 4]
    assert delta("kvserve:prompt_tokens_total") == 45 + 70 + 45
    assert delta("kvserve:generation_tokens_total") == 5 + 3 + 4
    assert delta("kvserve:prefix_cache_queries_total") == 45 + 70 + 45
    assert delta("kvserve:prefix_cache_hits_total") == (45 - 1) // block_size * block_size  # the last token is computed
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(f"kvserve:{name}_count") == 3, name
        assert delta(f"kvserve:{name}_bucket", le="+Inf") == 3, name
    assert delta("kvserve:inter_token_latency_seconds_count") == 4 + 2 + 3
    assert 0 < delta("kvserve:time_to_first_token_seconds_sum") < delta("kvserve:e2e_request_latency_seconds_sum")
    for name in ("num_preemptions_total", "failed_requests_total", "failed_steps_total", "worker_restarts_total"):
        assert delta(f"kvserve:{name}") == 0, name
    assert delta("kvserve:request_success_total", finished_reason="length") == 3
    assert delta("kvserve:request_success_total", finished_reason="stop") == 0
    assert delta("kvserve:request_success_total", finished_reason="abort") == 0
    assert delta("kvserve:request_prompt_tokens_sum") == 45 + 70 + 45
    assert delta("kvserve:request_generation_tokens_sum") == 5 + 3 + 4
    prompt_buckets = {"20.0": 0, "50.0": 2, "100.0": 3, "+Inf": 3}  # 45, 70, 45 tokens
    generation_buckets = {"2.0": 0, "5.0": 3, "+Inf": 3}  # 5, 3, 4 tokens
    for le, count in prompt_buckets.items():
        assert delta("kvserve:request_prompt_tokens_bucket", le=le) == count, le
    for le, count in generation_buckets.items():
        assert delta("kvserve:request_generation_tokens_bucket", le=le) == count, le
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert sample(after, f"kvserve:{gauge}") == 0.0, gauge
    stats = llm.stats()
    assert sample(after, "kvserve:prefix_cache_hits_total") == stats["prefix_cache_hits"]
    assert sample(after, "kvserve:prefix_cache_hit_rate") == pytest.approx(stats["prefix_cache_hit_rate"])


# --- a real Prometheus and the dashboard's queries ----------------------------------------------------


def prometheus_binary() -> str:
    found = os.environ.get("PROMETHEUS") or shutil.which("prometheus")
    assert found, "needs the prometheus binary on PATH or in $PROMETHEUS (Debian/Ubuntu: apt-get install prometheus)"
    return found


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of the dashboard, with Grafana's variables filled in as
    Grafana would for this model and a one-minute rate window."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "model_name"}
    queries = []
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", "1m").replace("$model_name", MODEL)
            assert "$" not in expr, expr
            queries.append((panel["title"], expr))
    return queries


def test_the_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels) and len({p["title"] for p in panels}) == len(panels)
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
    cells = {(p["gridPos"]["x"], p["gridPos"]["y"]) for p in panels}
    assert len(cells) == len(panels)  # no two panels on top of each other
    exprs = " ".join(expr for _, expr in panel_queries())
    for family in ("generation_tokens_total", "time_to_first_token_seconds_bucket",
                   "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                   "kv_cache_usage_perc", "num_requests_running", "num_requests_waiting",
                   "prefix_cache_hits_total", "failed_requests_total",
                   "worker_restarts_total", "request_success_total", "request_generation_tokens_bucket",
                   "request_prompt_tokens_bucket"):
        assert f"kvserve:{family}" in exprs, family


def test_the_shipped_prometheus_config_is_valid():
    promtool = Path(prometheus_binary()).with_name("promtool")
    result = subprocess.run([str(promtool), "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and "SUCCESS" in result.stdout + result.stderr, result.stdout + result.stderr
    (job,) = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["static_configs"] == [{"targets": ["127.0.0.1:8000"]}]


def test_prometheus_scrapes_the_app_and_answers_every_dashboard_query(app, llm, prompts, run, tmp_path):
    """Prometheus scrapes /metrics every second; after a first scrape, a few requests (two sharing
    300 prompt tokens); once two scrapes show the final token count, every panel query of the
    dashboard returns a non-empty result of finite numbers (rates over windows that hold the
    scrapes before and after the requests)."""
    import uvicorn

    binary = prometheus_binary()
    app_port, prom_port = free_port(), free_port()
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())  # the shipped one, at this test's pace and port
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{app_port}"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = tmp_path / "prometheus.log"
    queries = panel_queries()

    async def main():
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=app_port, log_level="warning",
                                               lifespan="off"))
        serving = asyncio.create_task(server.serve())
        with open(log, "wb") as out:
            prometheus = subprocess.Popen(
                [binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
                 f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=out, stderr=subprocess.STDOUT)
        try:
            async with httpx.AsyncClient(timeout=30) as http:
                api = f"http://127.0.0.1:{prom_port}/api/v1/query"

                async def query(expr: str) -> list[dict]:
                    response = await http.get(api, params={"query": expr})
                    body = response.json()
                    assert response.status_code == 200 and body["status"] == "success", (expr, body)
                    return body["data"]["result"]

                async def until(condition, what: str, timeout_s: float = 30.0) -> None:
                    deadline = asyncio.get_running_loop().time() + timeout_s
                    while True:
                        assert prometheus.poll() is None, f"prometheus exited: {log.read_text()[-2000:]}"
                        try:
                            if await condition():
                                return
                        except httpx.TransportError:  # not listening yet
                            pass
                        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
                        await asyncio.sleep(0.2)

                async def scraped_once() -> bool:
                    return [r["value"][1] for r in await query('up{job="kvserve"}')] == ["1"]

                async def ready() -> bool:  # it answers 503 "Service Unavailable" while its storage opens
                    return (await http.get(f"http://127.0.0.1:{prom_port}/-/ready")).status_code == 200

                await until(ready, "Prometheus to be ready", timeout_s=60)
                await until(scraped_once, "a first successful scrape")
                base = f"http://127.0.0.1:{app_port}"
                bodies = [(prompts[3], 6), (prompts[4], 4), (prompts[2], 8)]
                for prompt, max_tokens in bodies:
                    response = await http.post(f"{base}/v1/completions", headers=AUTH, json={
                        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                        "ignore_eos": True})
                    assert response.status_code == 200, response.text
                await until_clean(llm)
                total = llm.stats()["num_generation_tokens"]

                async def two_scrapes_after() -> bool:  # raw samples of the last 30 s
                    result = await query("kvserve:generation_tokens_total[30s]")
                    return len(result) == 1 and sum(float(v) == total for _, v in result[0]["values"]) >= 2

                await until(two_scrapes_after, "two scrapes after the requests")
                answers = {}
                for title, expr in queries:
                    answers[(title, expr)] = [(r["metric"], float(r["value"][1])) for r in await query(expr)]
        finally:
            prometheus.terminate()
            prometheus.wait(timeout=30)
            server.should_exit = True
            await serving
        return answers

    answers = run(main())
    empty = [key for key, values in answers.items() if not values]
    assert not empty, f"queries without data: {empty}"
    not_finite = {key: values for key, values in answers.items() if not all(math.isfinite(v) for _, v in values)}
    assert not not_finite, f"queries with NaN or infinite values: {not_finite}"

    def panel(title: str) -> list[float]:
        return [v for (t, _), values in answers.items() if t == title for _, v in values]

    assert len(panel("Token throughput")) == 2 and all(v > 0 for v in panel("Token throughput"))
    assert len(panel("Time to first token")) == 3 and all(v > 0 for v in panel("Time to first token"))
    assert 0 < panel("Prefix cache hit rate")[0] < 1  # two prompts share 300 tokens
    assert panel("Failures and recoveries") == [0.0] * 4
    (by_reason,) = [values for (title, _), values in answers.items() if title == "Finished requests by reason"]
    rates = {labels["finished_reason"]: rate for labels, rate in by_reason}
    assert rates["length"] > 0 and rates["stop"] == rates["abort"] == 0  # all ran to max_tokens
