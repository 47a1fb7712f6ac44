"""A scheduler actor that dies under Serve: its replica rebuilds it in place; meanwhile new requests get
503 with Retry-After (gRPC UNAVAILABLE), /health and /v1/models 503, the requests in flight end with
a clean error, nothing hangs; with no restarts allowed the health check fails and Serve replaces the
replica."""

from __future__ import annotations

import json
import threading
import time

import grpc
import httpx
import pytest

from api import kvserve_pb2 as pb
from api.errors import ENGINE_DEAD_MESSAGE
from benchmarks.chaos import INTERNALS
from api import kvserve_pb2_grpc as pb_grpc
from tests.serve.serve_harness import metrics, quick_stop, start_serve, stop_serve, wait_for

MODEL = "tiny"
# where the test is that Serve replaces an unhealthy replica: its health checked every 0.5 s (the app's
# 2 s): the 3 failed checks in a row Serve waits for take 1.5 s, not 6
REPLACED_SOON = {"health_check_period_s": 0.5}


@pytest.fixture(scope="module")
def served():
    base_url, grpc_address = start_serve()
    yield {"url": base_url, "grpc": grpc_address}
    stop_serve()


def deploy(model_dir: str, app: str, deployment_options: dict | None = None, **extra) -> None:
    from ray import serve

    from serve_app import build_app

    args = {"model": model_dir, "served_model_name": MODEL, "max_num_seqs": 4, "num_kv_blocks": 256,
            **quick_stop(**(deployment_options or {})), **extra}
    serve.run(build_app(args), name=app, route_prefix="/")


def undeploy(app: str) -> None:
    from ray import serve

    serve.delete(app)


def engine_names(app: str) -> list[str]:
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") == "kvserve" and a["name"].startswith(f"engine:{app}:"))


def kill_engine(app: str) -> str:
    import ray

    [name] = engine_names(app)
    ray.kill(ray.get_actor(name, namespace="kvserve"), no_restart=True)
    return name


def complete(url: str, timeout: float = 30) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 3},
                      timeout=timeout)


def assert_unavailable(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "2"
    error = r.json()["error"]
    assert error["code"] == "engine_unavailable" and error["type"] == "server_error"
    assert "Ray" not in error["message"] and not INTERNALS.search(error["message"]), error["message"]


def until_served(url: str, timeout_s: float) -> tuple[float, list[httpx.Response]]:
    """Completions one after another until one succeeds: (seconds it took, the refusals before it)."""
    start = time.monotonic()
    refused = []
    while time.monotonic() - start < timeout_s:
        r = complete(url)
        if r.status_code == 200:
            return time.monotonic() - start, refused
        refused.append(r)
        time.sleep(0.2)
    raise AssertionError(f"no completion within {timeout_s}s; last: {refused[-1].status_code} {refused[-1].text}")


def test_a_killed_scheduler_actor_is_rebuilt_and_refusals_are_clean(served, model_dirs, request):
    """At TP 2: the replica starts the rank actors beside the scheduler actor and owns them; the
    rebuilt engine runs on new ranks, the old ones gone (they would hold the bundles the new ones
    need), and its tokens are TP 1's."""
    import os

    import ray

    from engine import LLM, SamplingParams

    url = served["url"]
    deploy(model_dirs["llama"], "recover", tensor_parallel_size=2)
    request.addfinalizer(lambda: undeploy("recover"))  # a failure here must not leave "/" taken
    body = {"model": MODEL, "prompt": "two ranks", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with LLM(model=model_dirs["llama"], num_kv_blocks=256) as llm:
        [expected] = llm.generate("two ranks", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    first = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert first.json()["choices"][0]["text"] == expected.outputs[0].text
    assert httpx.get(f"{url}/health").status_code == 200
    [name] = engine_names("recover")
    old_ranks = ray.get(ray.get_actor(name, namespace="kvserve").worker_pids.remote())
    assert len(old_ranks) == 2

    in_flight: dict = {}

    def stream() -> None:
        body = {"model": MODEL, "prompt": "a long one", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            in_flight["status"] = response.status_code
            in_flight["lines"] = lines = []
            for line in response.iter_lines():
                lines.append(line)

    reader = threading.Thread(target=stream)
    reader.start()
    # killed once tokens flow (at TP 2 the first one takes a while after admission)
    wait_for(lambda: sum(line.startswith("data: ") for line in in_flight.get("lines", ())) >= 2,
             timeout_s=30, interval_s=0.05)
    killed = kill_engine("recover")

    # at once: the engine is gone and its successor takes seconds to start
    stub = pb_grpc.KVServeStub(grpc.insecure_channel(served["grpc"]))
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(pb.GenerateRequest(text="hi", params=pb.SamplingParameters(max_tokens=2)),
                      metadata=[("application", "recover")], timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert_unavailable(complete(url))
    health = wait_for(lambda: (r := httpx.get(f"{url}/health", timeout=10)).status_code == 503 and r,
                      timeout_s=10, interval_s=0.1)
    assert_unavailable(health)
    models = httpx.get(f"{url}/v1/models", timeout=10)
    assert_unavailable(models)

    reader.join(timeout=60)
    assert not reader.is_alive(), "the request in flight hangs"
    assert in_flight["status"] == 200  # the stream had started: it ends with an error event
    events = [line.removeprefix("data: ") for line in in_flight["lines"] if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 3  # some tokens came before the kill
    error = json.loads(events[-2])["error"]
    assert (error["code"], error["message"]) == (
        "engine_unavailable", "the engine stopped while serving this request; retry shortly")

    seconds, refused = until_served(url, timeout_s=60)
    for r in refused:
        assert_unavailable(r)
    print(f"a completion succeeds again {seconds:.1f}s after the first refusal")
    assert engine_names("recover") == [killed]  # the same replica, a new actor under the same name
    new_ranks = ray.get(ray.get_actor(killed, namespace="kvserve").worker_pids.remote())
    assert len(new_ranks) == 2 and not set(new_ranks) & set(old_ranks)
    for pid in old_ranks:  # killed, not left holding their bundles
        wait_for(lambda pid=pid: not os.path.exists(f"/proc/{pid}"), timeout_s=10)
    again = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert again.json()["choices"][0]["text"] == expected.outputs[0].text
    assert httpx.get(f"{url}/health").status_code == 200
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == [MODEL]
    reply = stub.Generate(pb.GenerateRequest(text="hi", params=pb.SamplingParameters(max_tokens=2, ignore_eos=True)),
                          metadata=[("application", "recover")], timeout=30)
    assert reply.usage.completion_tokens == 2
    final = metrics(url)
    assert final["kvserve:num_requests_running"] == 0 and final["kvserve:kv_cache_usage_perc"] == 0.0


def test_without_restarts_the_health_check_fails_and_serve_replaces_the_replica(served, model_dirs):
    url = served["url"]
    deploy(model_dirs["llama"], "replace", REPLACED_SOON, max_engine_restarts=0)
    assert complete(url).status_code == 200
    killed = kill_engine("replace")
    assert_unavailable(complete(url))
    seconds, refused = until_served(url, timeout_s=90)
    for r in refused:
        assert_unavailable(r)
    print(f"a new replica serves {seconds:.1f}s after the first refusal")
    [now] = engine_names("replace")
    assert now != killed  # another replica's engine
    assert httpx.get(f"{url}/health").status_code == 200
    from ray import serve

    serve.delete("replace")


def test_a_replica_that_cannot_be_placed_gets_503s_not_a_wait(served, model_dirs, monkeypatch):
    """On a cluster the build could not size (``cluster_cpus`` unknown, e.g. `serve run` against a
    remote RAY_ADDRESS), a replica asking for more CPUs than exist never starts: requests are refused
    with 503 at once, /health and /v1/models answer 503, instead of waiting for it forever."""
    from ray import serve

    import serve_app

    url = served["url"]
    monkeypatch.setattr(serve_app, "cluster_cpus", lambda: None)
    # a replica never placed cannot answer Serve's graceful stop: serve.delete would wait out its
    # graceful_shutdown_timeout_s (20 s by default) before killing it
    app = serve_app.build_app({"model": model_dirs["llama"], "served_model_name": MODEL, "engine_cpus": 64,
                               **quick_stop(graceful_shutdown_timeout_s=1)})
    serve.run_many([serve.RunTarget(target=app, name="unplaced", route_prefix="/")],
                   wait_for_applications_running=False)
    try:
        wait_for(lambda: httpx.get(f"{url}/health", timeout=10).status_code != 404, timeout_s=60, interval_s=0.1)
        started = time.monotonic()
        r = complete(url, timeout=30)
        assert time.monotonic() - started < 5
        assert_unavailable(r)
        assert r.json()["error"]["message"].startswith("no engine replica is serving yet")
        assert_unavailable(httpx.get(f"{url}/health", timeout=10))
        assert_unavailable(httpx.get(f"{url}/v1/models", timeout=10))
        status = serve.status().applications["unplaced"].deployments["LLMServer"]
        assert status.replica_states.get("RUNNING", 0) == 0
    finally:
        serve.delete("unplaced")


def test_an_engine_that_gives_up_on_its_ranks_is_replaced_with_its_replica(served, model_dirs):
    """tp = 2 with no rank rebuild allowed: a killed rank makes the engine dead (its actor still
    runs). New requests get 503, /health 503, the health check fails, and Serve replaces the replica."""
    import os
    import signal

    import ray

    url = served["url"]
    deploy(model_dirs["qwen2"], "giveup", REPLACED_SOON, tensor_parallel_size=2, max_worker_restarts=0)
    assert complete(url).status_code == 200
    [name] = engine_names("giveup")
    pids = ray.get(ray.get_actor(name, namespace="kvserve").worker_pids.remote())
    os.kill(pids[1], signal.SIGKILL)
    # the next step finds the rank gone and the engine gives up; a request may be the one that ran it
    first = complete(url)
    assert first.status_code in (500, 503), first.text
    if first.status_code == 500:  # in flight when the engine died: the rank's ActorDiedError stays in the log
        assert (first.json()["error"]["code"], first.json()["error"]["message"]) == ("engine_dead", ENGINE_DEAD_MESSAGE)
        assert_unavailable(complete(url))
    else:
        assert_unavailable(first)
    assert_unavailable(wait_for(lambda: (r := httpx.get(f"{url}/health", timeout=10)).status_code == 503 and r,
                                timeout_s=10, interval_s=0.2))
    seconds, refused = until_served(url, timeout_s=90)
    for r in refused:
        assert_unavailable(r)
    print(f"a new replica serves {seconds:.1f}s after the engine gave up")
    assert engine_names("giveup") != [name]
    assert httpx.get(f"{url}/health").status_code == 200
    from ray import serve

    serve.delete("giveup")
