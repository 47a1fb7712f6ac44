"""Two Ray nodes on this machine: a TP=2 group spread across both gives the TP=1 tokens, and so do PP=2
stages one on each; losing a node with nowhere to rebuild fails the pending requests with a clear
error instead of hanging (last: it removes the second node)."""

from __future__ import annotations

import pytest

from engine import LLM, EngineDeadError, SamplingParams
from tests.e2e.prompts import test_prompts as make_prompts

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "resources": {"node_a": 1}})
    second = cluster.add_node(num_cpus=2, resources={"node_b": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster, second
    ray.shutdown()
    cluster.shutdown()


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_tp2_across_two_nodes_matches_tp1(two_nodes, model_dirs):
    prompts = [{"prompt_token_ids": p} for p in make_prompts(model_dirs["opt"])]
    with LLM(model=model_dirs["opt"]) as llm1:
        expected = tokens(llm1.generate(prompts, PARAMS))
    with LLM(model=model_dirs["opt"], tensor_parallel_size=2, placement_strategy="STRICT_SPREAD") as llm:
        nodes = llm.stats()["worker_nodes"]
        assert len(set(nodes)) == 2, nodes
        assert tokens(llm.generate(prompts, PARAMS)) == expected


def test_pp2_stages_on_two_nodes_match_tp1_and_hf(two_nodes, model_dirs, hf_oracle):
    """Each pipeline stage on a node of its own (STRICT_SPREAD, one rank per stage): the activations
    cross between the nodes' processes, two steps in flight; the tokens of one rank, exact against HF."""
    prompts = [{"prompt_token_ids": p} for p in make_prompts(model_dirs["llama"])]
    with LLM(model=model_dirs["llama"]) as llm1:
        expected = tokens(llm1.generate(prompts, PARAMS))
    with LLM(model=model_dirs["llama"], pipeline_parallel_size=2, placement_strategy="STRICT_SPREAD") as llm:
        nodes = llm.stats()["worker_nodes"]
        assert len(set(nodes)) == 2, nodes
        assert tokens(llm.generate(prompts, PARAMS)) == expected
    for prompt, out in zip(prompts, expected):
        hf_oracle("llama").assert_greedy(prompt["prompt_token_ids"], out)


def test_lost_node_without_a_replacement_fails_requests_clearly(two_nodes, model_dirs):
    cluster, second = two_nodes
    prompts = [{"prompt_token_ids": p} for p in make_prompts(model_dirs["opt"])]
    llm = LLM(model=model_dirs["opt"], tensor_parallel_size=2, placement_strategy="STRICT_SPREAD")
    core = llm.core
    for i, p in enumerate(prompts):
        core.add_request(str(i), p["prompt_token_ids"], PARAMS)
    core.step()
    cluster.remove_node(second)
    with pytest.raises(EngineDeadError, match="STRICT_SPREAD needs 2 nodes"):
        for _ in range(1000):
            core.step()
    for i in range(len(prompts)):
        core.abort_request(str(i))
    assert llm.stats()["num_blocks_in_use"] == 0

