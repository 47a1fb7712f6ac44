"""Two replicas and four system prompts: the prefix-aware router keeps each prompt on the replica
that caches it, so the fleet's prefix-cache hit rate beats plain power-of-two routing."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.prompts import corpus_ids
from tests.serve.serve_harness import metrics, start_serve, stop_serve, wait_for

NUM_SYSTEM_PROMPTS = 4
REQUESTS_PER_PROMPT = 8


@pytest.fixture(scope="module")
def cluster():
    base_url, _ = start_serve(num_cpus=10)
    yield base_url
    stop_serve()


def workload(model_dir: str) -> list[list[int]]:
    """Interleaved: system prompt i (160 tokens) + a distinct 12-token question, round-robin."""
    ids = list(corpus_ids(f"{model_dir}/tokenizer.json"))
    systems = [ids[1000 + 400 * i: 1160 + 400 * i] for i in range(NUM_SYSTEM_PROMPTS)]
    return [systems[j % NUM_SYSTEM_PROMPTS] + ids[5000 + 12 * j: 5012 + 12 * j]
            for j in range(NUM_SYSTEM_PROMPTS * REQUESTS_PER_PROMPT)]


def fleet_hit_rate(base_url: str, model_dir: str, router: str) -> float:
    from ray import serve

    from serve_app import build_app

    args = {"model": model_dir, "served_model_name": "tiny", "num_replicas": 2, "router": router,
            "num_kv_blocks": 512, "max_num_seqs": 8}
    serve.run(build_app(args), name=f"routing-{router}", route_prefix="/")
    wait_for(lambda: len(_replicas(f"routing-{router}")) == 2)
    for prompt in workload(model_dir):
        r = httpx.post(f"{base_url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200, r.text
    m = metrics(base_url)
    serve.delete(f"routing-{router}")
    return m["kvserve:prefix_cache_hits_total"] / m["kvserve:prefix_cache_queries_total"]


def _replicas(app: str) -> list:
    from ray import serve

    status = serve.status().applications[app].deployments["LLMServer"]
    return [r for r, n in status.replica_states.items() if r == "RUNNING" for _ in range(n)]


def test_prefix_router_beats_power_of_two(cluster, model_dirs):
    pow2 = fleet_hit_rate(cluster, model_dirs["llama"], "pow2")
    prefix = fleet_hit_rate(cluster, model_dirs["llama"], "prefix")
    print(f"fleet prefix-cache hit rate: prefix router {prefix:.3f}, power-of-two {pow2:.3f}")
    # prefix routing computes each system prompt once; random routing about once per replica
    assert prefix > pow2 + 0.05, (prefix, pow2)
    assert prefix > 0.75


def test_tensor_parallel_replica_keeps_its_ranks_in_its_placement_group(cluster, model_dirs):
    from ray import serve

    from engine import LLM, SamplingParams
    from serve_app import build_app

    args = {"model": model_dirs["qwen2"], "served_model_name": "tiny", "tensor_parallel_size": 2,
            "num_kv_blocks": 256}
    serve.run(build_app(args), name="tp2", route_prefix="/")
    r = httpx.post(f"{cluster}/v1/completions", json={"model": "tiny", "prompt": "Two ranks", "max_tokens": 6,
                                                      "temperature": 0, "ignore_eos": True}, timeout=60)
    with LLM(model=model_dirs["qwen2"], num_kv_blocks=256) as llm:
        expected = llm.generate("Two ranks", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert r.json()["choices"][0]["text"] == expected[0].outputs[0].text
    placement = serve.get_deployment_handle("LLMServer", app_name="tp2").placement.remote().result()
    assert placement["replica"] is not None and len(placement["ranks"]) == 2
    # the replica, its scheduler actor and both ranks live in the replica's one placement group
    assert {placement["replica"], placement["scheduler"], *placement["ranks"]} == {placement["replica"]}
    serve.delete("tp2")
