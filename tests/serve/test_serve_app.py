"""kvserve on Ray Serve, end to end: the official openai client, Python handles, gRPC through Serve's
proxy, /metrics moving, the queue bound, and a client that disconnects mid-stream."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
import httpx
import openai
import pytest

from api import kvserve_pb2 as pb
from api import kvserve_pb2_grpc as pb_grpc
from engine import LLM, SamplingParams
from tests.serve.serve_harness import metrics, start_serve, stop_serve, wait_for

API_KEY = "sk-serve-test"
MODEL = "tiny"


@pytest.fixture(scope="module")
def served(model_dirs):
    from ray import serve

    from serve_app import build_app

    base_url, grpc_address = start_serve()
    args = {"model": model_dirs["llama"], "served_model_name": MODEL, "api_key": API_KEY, "max_num_seqs": 4,
            "max_waiting_requests": 4, "num_kv_blocks": 600, "engine_cpus": 1}
    handle = serve.run(build_app(args), name="kvserve", route_prefix="/")
    yield {"url": base_url, "grpc": grpc_address, "handle": handle, "model_dir": model_dirs["llama"]}
    stop_serve()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served['url']}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(served):
    with LLM(model=served["model_dir"], num_kv_blocks=256) as llm:
        yield llm


def greedy_text(offline, prompt, max_tokens):
    out = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return out[0].outputs[0].text


def test_completion_equals_offline_engine(client, offline):
    r = client.completions.create(model=MODEL, prompt="The river bends", max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == greedy_text(offline, "The river bends", 10)
    assert r.usage.completion_tokens == 10 and r.choices[0].finish_reason == "length"


def test_chat_streaming_with_usage_n_and_logprobs(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about bread"}], max_tokens=6, n=2,
        temperature=0.9, seed=5, logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True})
    texts, finishes, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
            if choice.logprobs and choice.logprobs.content:
                assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert set(finishes) == {0, 1} and usage.completion_tokens >= 2
    assert usage.prompt_tokens > 0


def test_errors_have_openai_bodies(served, client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", top_p=1.5)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.BadRequestError, match="max_model_len|maximum context"):
        client.completions.create(model=MODEL, prompt=[5] * 5000)
    bad_key = openai.OpenAI(base_url=f"{served['url']}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    r = httpx.post(f"{served['url']}/v1/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert [m.id for m in client.models.list()] == [MODEL]


def test_request_caps_through_serve(served):
    """The app's default caps reach the Ingress: 256 prompts per request, a 32 MiB body (413 before
    it is parsed), max_logprobs 20."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{served['url']}/v1/completions", headers=auth, timeout=60,
                   json={"model": MODEL, "prompt": [[5]] * 257, "max_tokens": 1})
    assert r.status_code == 400 and "max_prompts_per_request" in r.json()["error"]["message"]
    r = httpx.post(f"{served['url']}/v1/completions", content=b" " * (32 * 2**20 + 1), timeout=60,
                   headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 413 and "max_request_body_bytes" in r.json()["error"]["message"]
    r = httpx.post(f"{served['url']}/v1/completions", headers=auth, timeout=60,
                   json={"model": MODEL, "prompt": "x", "max_tokens": 1, "logprobs": 21})
    assert r.json()["error"]["message"] == "logprobs must be at most 20 (the server's max_logprobs), got 21"


def test_python_handles(served, offline):
    handle = served["handle"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    final = handle.generate.remote("Salt and pepper", params).result()
    assert final.finished and final.outputs[0].text == greedy_text(offline, "Salt and pepper", 8)
    deltas = list(handle.options(stream=True).generate_stream.remote("Salt and pepper", params))
    assert "".join(d.outputs[0].text for d in deltas if d.outputs) == final.outputs[0].text
    assert deltas[-1].finished


def test_prompt_logprobs_through_a_python_handle(served, offline):
    """SamplingParams.prompt_logprobs over the handle: the final output carries the engine's values
    (they cross the scheduler actor's stream and the deltas' merge)."""
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    final = served["handle"].generate.remote([5, 17, 300, 41], params).result()
    expected = offline.generate({"prompt_token_ids": [5, 17, 300, 41]}, params)[0].prompt_logprobs
    assert final.prompt_logprobs[0] is None and len(final.prompt_logprobs) == 4
    for got, want in zip(final.prompt_logprobs[1:], expected[1:]):
        assert set(got) == set(want)
        assert all(got[t][0] == pytest.approx(want[t][0], abs=1e-5) and got[t][1] == want[t][1] for t in want)


def test_python_handles_take_openai_bodies(served, offline):
    """handle.completions / chat (and their _stream forms) take OpenAI request bodies and return what
    the HTTP API would; a bad body raises OpenAIError with the API's status and body."""
    from api.errors import OpenAIError

    handle = served["handle"]
    body = {"model": MODEL, "prompt": "Salt and pepper", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    completion = handle.completions.remote(body).result()
    assert completion["object"] == "text_completion" and completion["usage"]["completion_tokens"] == 8
    assert completion["choices"][0]["text"] == greedy_text(offline, "Salt and pepper", 8)
    chunks = list(handle.options(stream=True).completions_stream.remote(body))
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == completion["choices"][0]["text"]
    chat_body = {"model": MODEL, "messages": [{"role": "user", "content": "Name a spice"}], "max_tokens": 5,
                 "temperature": 0, "ignore_eos": True}
    chat = handle.chat.remote(chat_body).result()
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] == 5
    want = offline.chat(chat_body["messages"], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert chat["choices"][0]["message"]["content"] == want[0].outputs[0].text
    streamed = list(handle.options(stream=True).chat_stream.remote(chat_body))
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in streamed if c["choices"]) == \
        chat["choices"][0]["message"]["content"]
    for bad, param in (({**body, "top_p": 2.0}, "top_p"), ({**body, "stream": True}, "stream")):
        with pytest.raises(OpenAIError) as err:
            handle.completions.remote(bad).result()
        assert err.value.status == 400 and err.value.body()["error"]["param"] == param


def test_python_handle_chat_with_a_named_tool(served):
    """A named tool_choice through the handle: the output is constrained to that function's arguments,
    answered as tool_calls; the streamed pieces assemble to the same arguments."""
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
        "additionalProperties": False}}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Time?"}], "tools": tools, "seed": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}}, "max_tokens": 64}
    choice = served["handle"].chat.remote(body).result()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    assert isinstance(json.loads(call["function"]["arguments"])["utc"], bool)
    chunks = list(served["handle"].options(stream=True).chat_stream.remote(body))
    pieces = [p for c in chunks if c["choices"] for p in c["choices"][0]["delta"].get("tool_calls", [])]
    assert "".join(p["function"].get("arguments", "") for p in pieces) == call["function"]["arguments"]


def test_malformed_requests_through_serve_get_4xx_and_spare_good_ones(served, offline):
    """The fuzz driver's malformed requests through Serve's proxy and the Ingress (the in-process app
    takes the large runs: tests/serve/test_fuzz_http.py): each a 4xx with an OpenAI error body, none a
    5xx or a hang, while good greedy completions beside them return the offline engine's text."""
    import random

    from benchmarks.fuzz import GOOD_BODY, fuzz, malformed_case

    rng = random.Random(11)
    cases = [malformed_case(rng) for _ in range(120)]
    expected = greedy_text(offline, GOOD_BODY["prompt"], GOOD_BODY["max_tokens"])

    async def main():
        async with httpx.AsyncClient(base_url=served["url"], headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=30) as http:
            return await fuzz(http, cases, expected, concurrency=8, timeout_s=20.0, good_streams=2)

    report = asyncio.run(main())
    assert report.tried == 120 and report.error_body_4xx == 120, report.summary()
    assert (report.server_errors, report.hangs, report.accepted, report.collateral) == (0, 0, 0, 0), report.summary()
    assert report.good >= 2


def test_grpc_through_serve_proxy(served, offline):
    stub = pb_grpc.KVServeStub(grpc.insecure_channel(served["grpc"]))
    request = pb.GenerateRequest(text="A quiet morning", params=pb.SamplingParameters(
        max_tokens=7, temperature=0.0, ignore_eos=True))
    authorized = [("application", "kvserve"), ("authorization", f"Bearer {API_KEY}")]
    unary = stub.Generate(request, metadata=authorized)
    assert unary.completions[0].text == greedy_text(offline, "A quiet morning", 7)
    assert unary.usage.completion_tokens == 7
    streamed = list(stub.GenerateStream(request, metadata=authorized))
    assert "".join(c.text for m in streamed for c in m.completions) == unary.completions[0].text
    assert streamed[-1].usage.completion_tokens == 7
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(pb.GenerateRequest(text="x", params=pb.SamplingParameters(top_p=2.0)), metadata=authorized)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # the app's api_key guards gRPC as it guards HTTP: no key, or a wrong one, is UNAUTHENTICATED
    for metadata in ([("application", "kvserve")], [("application", "kvserve"), ("authorization", "Bearer wrong")]):
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(request, metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            list(stub.GenerateStream(request, metadata=metadata))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_requests_sharing_a_client_id_through_serve(served, offline):
    """Two streams at once with one request_id through Serve's proxy (the id is the client's label,
    the engine's ids are the Ingress's own): both complete with their own tokens, each echoing it."""
    from concurrent.futures import ThreadPoolExecutor

    stub = pb_grpc.KVServeStub(grpc.insecure_channel(served["grpc"]))
    authorized = [("application", "kvserve"), ("authorization", f"Bearer {API_KEY}")]

    def stream(prompt: str) -> tuple[set[str], str]:
        request = pb.GenerateRequest(text=prompt, request_id="mine", params=pb.SamplingParameters(
            max_tokens=40, temperature=0.0, ignore_eos=True))
        messages = list(stub.GenerateStream(request, metadata=authorized, timeout=60))
        return {m.request_id for m in messages}, "".join(c.text for m in messages for c in m.completions)

    prompts = ["A quiet morning", "The river bends"]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(stream, prompts))
    assert results == [({"mine"}, greedy_text(offline, p, 40)) for p in prompts]


def test_metrics_are_present_and_move(served, client):
    before = metrics(served["url"])
    for name in ("kvserve:prefix_cache_queries_total", "kvserve:kv_cache_usage_perc",
                 "kvserve:num_requests_waiting", "kvserve:time_to_first_token_seconds_count",
                 "kvserve:request_queue_time_seconds_sum", "kvserve:e2e_request_latency_seconds_count"):
        assert name in before, name
    prompt = "The same long preamble for every request. " * 20
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    after = metrics(served["url"])
    assert after["kvserve:generation_tokens_total"] >= before["kvserve:generation_tokens_total"] + 10
    assert after["kvserve:prefix_cache_hits_total"] > before["kvserve:prefix_cache_hits_total"]
    assert after["kvserve:time_to_first_token_seconds_count"] >= before["kvserve:time_to_first_token_seconds_count"] + 2
    response = httpx.get(f"{served['url']}/metrics")
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    # prometheus_client's parser reads it; one replica, every sample labelled by model and replica
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    assert families["kvserve:generation_tokens"].type == "counter"
    assert families["kvserve:time_to_first_token_seconds"].type == "histogram"
    replicas = {s.labels["replica"] for f in families.values() for s in f.samples}
    assert len(replicas) == 1 and all(s.labels["model_name"] == MODEL for f in families.values() for s in f.samples)
    (generated,) = [s.value for s in families["kvserve:generation_tokens"].samples]
    assert generated >= after["kvserve:generation_tokens_total"]
    ttft = families["kvserve:time_to_first_token_seconds"].samples
    (inf_bucket,) = [s.value for s in ttft if s.name.endswith("_bucket") and s.labels["le"] == "+Inf"]
    (count,) = [s.value for s in ttft if s.name.endswith("_count")]
    assert inf_bucket == count >= 2


def test_disconnect_mid_stream_frees_the_blocks(served):
    body = {"model": MODEL, "prompt": "Once more, with feeling", "max_tokens": 1500, "stream": True,
            "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{served['url']}/v1/completions", json=body, headers=headers) as response:
            chunks = 0
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                if chunks >= 3:
                    break
    assert chunks == 3
    wait_for(lambda: (m := metrics(served["url"]))["kvserve:num_requests_running"] == 0
             and m["kvserve:kv_cache_usage_perc"] == 0.0, timeout_s=30)


def test_queue_bound_gives_503_and_spares_the_rest(served):
    """The replica holds max_num_seqs + max_waiting_requests = 8 requests (4 running, 4 waiting) and
    the Ingress's handle queues 8 more; with those places taken, more requests get 503 at once (a bad
    one too: refused at the Ingress's door, before its body is read), and the long requests are
    unharmed (and freed when their clients leave)."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    # as long as the tiny model's 2048 positions allow: at ~230 tokens/s a stream (the 2-core AMD VM)
    # the running ones must outlast the ~6 s of the checks below
    body = {"model": MODEL, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    stop = threading.Event()
    progress = [0] * 16

    statuses: dict[int, int] = {}
    refusals: dict[int, str] = {}

    def hold(i: int) -> None:  # a long stream, read until told to leave
        with httpx.stream("POST", f"{served['url']}/v1/completions", json={**body, "prompt": f"long {i}"},
                          headers=headers, timeout=120) as response:
            statuses[i] = response.status_code
            if response.status_code != 200:  # its code, for the message below
                refusals[i] = json.loads(response.read()).get("error", {}).get("code")
            for line in response.iter_lines():
                progress[i] += line.startswith("data: {")
                if stop.is_set():
                    return

    threads = [threading.Thread(target=hold, args=(i,), daemon=True) for i in range(16)]
    try:
        for i, t in enumerate(threads):
            t.start()
            # one at a time: each of the replica's eight is placed before the next arrives (the Ingress
            # queues the other eight in any order)
            time.sleep(0.2 if i < 8 else 0.05)
        wait_for(lambda: (m := metrics(served["url"]))["kvserve:num_requests_running"] == 4
                 and m["kvserve:num_requests_waiting"] == 4, timeout_s=60)
        # the four running ones are streaming, the waiting ones not: checked now, while the running ones
        # are still far from their 2000 tokens (on a fast machine they end within the test)
        wait_for(lambda: sum(p > 0 for p in progress) >= 4, timeout_s=30, interval_s=0.05)
        assert sum(p > 0 for p in progress) == 4
        time.sleep(2)  # the last eight are now queued in the Ingress's router

        def one_more() -> int | None:
            try:
                r = httpx.post(f"{served['url']}/v1/completions", json={"model": MODEL, "prompt": "one more",
                               "max_tokens": 5}, headers=headers, timeout=5)
            except httpx.TimeoutException:  # queued behind the held ones
                return None
            assert r.status_code != 503 or r.json()["error"]["code"] == "engine_overloaded"
            return r.status_code

        # Serve's count of a replica's requests can lag its engine's by one, so a place may be left
        assert any(one_more() == 503 for _ in range(3))
        bad = httpx.post(f"{served['url']}/v1/completions", json={"model": MODEL, "prompt": "x", "temperature": -2},
                         headers=headers, timeout=30)
        assert bad.status_code == 503 and bad.json()["error"]["code"] == "engine_overloaded"
        assert bad.headers["retry-after"] == "2"
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert set(statuses.values()) <= {200, 503} and list(statuses.values()).count(200) >= 12, refusals
    wait_for(lambda: (m := metrics(served["url"]))["kvserve:num_requests_running"] == 0
             and m["kvserve:num_requests_waiting"] == 0 and m["kvserve:kv_cache_usage_perc"] == 0.0, timeout_s=60)


def test_bench_online_every_workload_through_serve(served, offline):
    """`kvserve bench` against the running app: every workload at a fixed concurrency and at a
    Poisson rate, tokens counted from the stream equal to those asked for and to the offline
    engine's greedy tokens; the server's prefix cache shows in the hit rate."""
    from benchmarks.cli import bench
    from benchmarks.online import run_online
    from benchmarks.workloads import WORKLOADS, build_workload

    report = bench(served["model_dir"], workloads=list(WORKLOADS), systems=["serve-http"], scale=0.05,
                   output_len=3, concurrency=[2], request_rates=[20.0], url=served["url"],
                   served_model_name=MODEL, api_key=API_KEY, overhead_seqs=0, progress=False)
    for name, section in report["workloads"].items():
        workload = build_workload(name, served["model_dir"], 0.05, 3)
        wanted = sum(r.output_len for r in workload.requests)
        assert [run["name"] for run in section["online"]] == ["kvserve-serve-http-c2", "kvserve-serve-http-r20"]
        for run in section["online"]:
            assert run["num_failed"] == 0, run["errors"]
            assert run["output_tokens"] == wanted
            # one latency sample per token after each request's first chunk; consecutive steps of a
            # fast engine may reach a slow reader as one chunk, so the first chunk can hold several
            assert run["itl_s"]["count"] <= wanted - len(workload.requests)
            assert 0.0 <= run["prefix_cache_hit_rate"] <= 1.0 and run["num_preemptions"] == 0
            assert 0 < run["ttft_s"]["p50"] <= run["e2e_s"]["p99"] <= run["elapsed_s"]
    shared = report["workloads"]["shared-system-prompt"]["online"][0]
    assert shared["prefix_cache_hit_rate"] > 0.5  # a fresh cache salt per run: only in-run reuse counts

    import asyncio

    workload = build_workload("mixed", served["model_dir"], 0.05, 3)
    run = asyncio.run(run_online(served["url"], MODEL, workload, concurrency=2, api_key=API_KEY))
    expected = offline.generate([{"prompt_token_ids": r.prompt} for r in workload.requests],
                                [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
                                 for r in workload.requests])
    assert run["token_ids"] == [o.outputs[0].token_ids for o in expected]

