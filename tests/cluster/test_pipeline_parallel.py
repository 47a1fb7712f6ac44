"""Pipeline parallelism: the layers in contiguous stages of Ray rank actors, activations passed stage
to stage, the last stage sampling. Exact against Hugging Face (teacher forcing) and equal to one rank
at PP 2, PP 2 x TP 2, PP 3 with an uneven split (chunked prefill, preemption, prefix-cache hits) and
for a mixture-of-experts model; a rank of the second stage killed mid-run changes no token; the
splits, each stage's share of the checkpoint and the configurations refused."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from engine import LLM, SamplingParams, engine_config
from engine.config import ParallelConfig
from tests.cluster.conftest import count_in_flight, generate
from tests.e2e.prompts import test_prompts as make_prompts
from workers.model_builder import make_model


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    return str(make_model("mixtral", "tiny", tmp_path_factory.mktemp("pp") / "mixtral", seed=1))


def test_stage_layers_split_evenly_or_as_given():
    assert ParallelConfig(pipeline_parallel_size=2).stage_layers(5) == [(0, 3), (3, 5)]
    assert ParallelConfig(pipeline_parallel_size=3).stage_layers(5) == [(0, 2), (2, 4), (4, 5)]
    assert ParallelConfig(pipeline_parallel_size=4).stage_layers(8) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert ParallelConfig(pipeline_parallel_size=3, pipeline_layer_split=[1, 3, 1]).stage_layers(5) == [
        (0, 1), (1, 4), (4, 5)]
    assert ParallelConfig().stage_layers(7) == [(0, 7)]
    with pytest.raises(ValueError, match=r"pipeline_layer_split \[2, 2\] gives 4 layers; the model has 5"):
        ParallelConfig(pipeline_parallel_size=2, pipeline_layer_split=(2, 2)).stage_layers(5)
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 is more stages than the model's 2 layers"):
        ParallelConfig(pipeline_parallel_size=3).stage_layers(2)
    with pytest.raises(ValueError, match="a layer count >= 1 for each of the 2 pipeline stages"):
        ParallelConfig(pipeline_parallel_size=2, pipeline_layer_split=(5,))
    with pytest.raises(ValueError, match="a layer count >= 1 for each of the 2 pipeline stages"):
        ParallelConfig(pipeline_parallel_size=2, pipeline_layer_split=(5, 0))
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an integer >= 1, got 0"):
        ParallelConfig(pipeline_parallel_size=0)


def test_configurations_refused_before_any_rank_starts(model_dirs, five_layers, monkeypatch):
    import engine.parallel_config as parallel_config

    # every architecture runs in stages (OPT and Gemma: tests/cluster/test_pipeline_parallel_families.py);
    # one that did not would be refused with this sentence
    assert engine_config(model_dirs["opt"], pipeline_parallel_size=2).parallel.world_size == 2
    monkeypatch.setattr(parallel_config, "PIPELINE_ARCHITECTURES",
                        parallel_config.PIPELINE_ARCHITECTURES - {"OPTForCausalLM"})
    with pytest.raises(ValueError, match=r"pipeline_parallel_size 2 is not supported for OPTForCausalLM \(it is for"):
        engine_config(model_dirs["opt"], pipeline_parallel_size=2)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="is more stages than the model's 2 layers"):
        engine_config(model_dirs["llama"], pipeline_parallel_size=3)
    with pytest.raises(ValueError, match=r"gives 4 layers; the model has 5"):
        engine_config(five_layers[0], pipeline_parallel_size=2, pipeline_layer_split=[1, 3])
    with pytest.raises(ValueError, match=r"pipeline_layer_split \[4\] gives 4 layers; the model has 5"):
        engine_config(five_layers[0], pipeline_layer_split=[4])
    with pytest.raises(ValueError, match=r"batches_in_flight=2 needs pipeline_parallel_size > 1 \(a step in flight"):
        engine_config(five_layers[0], batches_in_flight=2)
    for dispatch in ("remote", "compiled"):
        parallel = engine_config(five_layers[0], pipeline_parallel_size=2, tp_dispatch=dispatch).parallel
        assert parallel.steps_in_flight == 2
        assert engine_config(five_layers[0], pipeline_parallel_size=2, tp_dispatch=dispatch,
                             batches_in_flight=3).parallel.steps_in_flight == 3
    assert engine_config(five_layers[0], tensor_parallel_size=2).parallel.steps_in_flight == 1
    config = engine_config(five_layers[0], pipeline_parallel_size=2, tensor_parallel_size=2)
    assert config.parallel.world_size == 4


def test_each_stage_holds_and_loads_only_its_share_of_the_checkpoint(five_layers):
    """Stage 0 of 1 + 3 + 1: the embedding and layer 0; stage 1: layers 1-3; stage 2: layer 4, the
    final norm and the LM head. Each loads exactly those tensors, equal to the checkpoint's."""
    from safetensors.torch import load_file

    from engine.config import ModelConfig
    from workers.models.registry import resolve_architecture
    from workers.parallel_state import PipelineStage, TPGroup
    from workers.weight_loader import iter_checkpoint

    path = five_layers[0]
    hf_config = ModelConfig.from_dir(path).hf_config
    checkpoint = load_file(os.path.join(path, "model.safetensors"))
    held = {}
    for rank, (start, end) in enumerate([(0, 1), (1, 4), (4, 5)]):
        model = resolve_architecture(hf_config)(hf_config, TPGroup(), torch.float32, torch.device("cpu"),
                                                stage=PipelineStage(rank, 3, start, end, 5))
        model.load_weights(iter_checkpoint(path))
        params = dict(model.named_parameters())
        held[rank] = params
        for name, param in params.items():
            if ".qkv_proj." in name or ".gate_up_proj." in name:
                continue  # fused here: compared below through their parts
            assert torch.equal(param, checkpoint[name]), name
        layers = {int(n.split(".")[2]) for n in params if n.startswith("model.layers.")}
        assert layers == set(range(start, end))
        q = checkpoint[f"model.layers.{start}.self_attn.q_proj.weight"]
        assert torch.equal(params[f"model.layers.{start}.self_attn.qkv_proj.weight"][:q.shape[0]], q)
    assert "model.embed_tokens.weight" in held[0] and "lm_head.weight" not in held[0]
    assert "model.norm.weight" not in held[0] and "model.norm.weight" not in held[1]
    assert not any(n.startswith(("model.embed_tokens", "lm_head")) for n in held[1])
    assert "model.embed_tokens.weight" not in held[2] and {"model.norm.weight", "lm_head.weight"} <= set(held[2])


def test_pp2_matches_hf_and_one_rank_with_two_steps_in_flight_or_one(ray_cluster, model_dirs, hf_oracle):
    """By actor calls PP 2 keeps a step in each stage (the default, one per stage);
    batches_in_flight=1 sends one at a time. The tokens of one rank, exact against Hugging Face, and
    every block comes back."""
    prompts = make_prompts(model_dirs["llama"])
    with LLM(model=model_dirs["llama"], num_kv_blocks=256) as llm1:
        expected, one = generate(llm1, prompts), llm1.stats()
    runs = {}
    for in_flight in (None, 1):
        with LLM(model=model_dirs["llama"], pipeline_parallel_size=2, num_kv_blocks=256,
                 batches_in_flight=in_flight) as llm:
            counts = count_in_flight(llm)
            runs[in_flight] = generate(llm, prompts), llm.stats()
        # (one at a time is the engine's plain step: nothing goes through submit)
        assert max(counts, default=1) == (in_flight or 2) and runs[in_flight][1]["num_blocks_in_use"] == 0
    tokens, stats = runs[None]
    assert tokens == expected and runs[1][0] == expected
    for prompt, out in zip(prompts, tokens):
        hf_oracle("llama").assert_greedy(prompt, out)
    # each stage holds one of the two layers' KV; the scheduler is the one of a single rank
    assert stats["kv_pool_bytes_by_rank"] == [one["kv_pool_bytes_per_rank"] // 2] * 2
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (one["prefix_cache_queries"],
                                                                        one["prefix_cache_hits"])


def test_pp2_by_tp2_matches_hf_and_a_second_stage_rank_killed_mid_run_changes_no_token(ray_cluster, five_layers):
    """PP 2 x TP 2 exact against Hugging Face, each stage's pool split over its ranks. Then, in the same
    engine, a rank of the second stage is killed mid-run: the whole group is rebuilt (each stage is
    useless without the others) and the running requests are recomputed: the tokens of a run without
    the failure."""
    path, oracle = five_layers
    prompts = make_prompts(path)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(model=path, pipeline_parallel_size=2, tensor_parallel_size=2, num_kv_blocks=256) as llm:
        tokens, stats = generate(llm, prompts), llm.stats()
        for prompt, out in zip(prompts, tokens):
            oracle.assert_greedy(prompt, out)
        pool = stats["kv_pool_bytes_by_rank"]  # stage 0 holds 3 layers, stage 1 two, each over two ranks
        assert len(pool) == 4 and pool[0] == pool[1] and pool[2] == pool[3] and 2 * pool[0] == 3 * pool[2]

        expected = generate(llm, prompts, params)
        core = llm.core
        for i, prompt in enumerate(prompts):
            core.add_request(str(i), prompt, params)
        for _ in range(4):
            assert not any(out.finished for out in core.step())
        old = core.executor.worker_pids()
        os.kill(old[3], signal.SIGKILL)  # stage 1, tensor-parallel rank 1
        finals = {}
        while core.has_unfinished_requests():
            for out in core.step():
                if out.finished:
                    finals[out.request_id] = out.outputs[0].token_ids
        stats = llm.stats()
        assert not set(core.executor.worker_pids()) & set(old)
    assert [finals[str(i)] for i in range(len(prompts))] == expected
    assert stats["num_worker_restarts"] == 1 and stats["num_blocks_in_use"] == 0


def test_pp3_uneven_with_chunked_prefill_preemption_and_cache_hits(ray_cluster, five_layers):
    """1 + 3 + 1 layers, three steps in flight, a pool small enough to preempt and a budget that chunks
    every prompt: the tokens of one rank with the same settings, exact against Hugging Face."""
    path, oracle = five_layers
    prompts = make_prompts(path)
    kwargs = dict(block_size=16, num_kv_blocks=48, max_model_len=520, max_num_batched_tokens=64)
    with LLM(model=path, **kwargs) as llm1:
        expected, one = generate(llm1, prompts), llm1.stats()
    with LLM(model=path, pipeline_parallel_size=3, pipeline_layer_split=[1, 3, 1], **kwargs) as llm:
        counts = count_in_flight(llm)
        tokens, stats = generate(llm, prompts), llm.stats()
        again = generate(llm, prompts[-2:])  # the last prompts again: their blocks are the cache's newest
        hits = llm.stats()["prefix_cache_hits"] - stats["prefix_cache_hits"]
    assert tokens == expected and again == expected[-2:]
    for prompt, out in zip(prompts, tokens):
        oracle.assert_greedy(prompt, out)
    # three steps in flight, one per stage: requests preempted (their blocks handed on) while a step of
    # theirs was out, and planned again; how often depends on the planning, not the tokens
    assert max(counts) == 3 and stats["num_preemptions"] > 0 and one["num_preemptions"] > 0
    assert hits > 0
    pool = stats["kv_pool_bytes_by_rank"]
    assert pool[1] == 3 * pool[0] == 3 * pool[2]
    assert stats["kv_pool_bytes_per_rank"] == pool[1]  # the per-rank figures: the stage with the most layers


def test_pp2_mixture_of_experts_matches_one_rank(ray_cluster, mixtral_dir):
    prompts = make_prompts(mixtral_dir)
    with LLM(model=mixtral_dir) as llm1:
        expected = generate(llm1, prompts)
    with LLM(model=mixtral_dir, pipeline_parallel_size=2) as llm:
        assert generate(llm, prompts) == expected


def test_bench_parallel_smoke_every_configuration_and_dispatch(ray_cluster, model_dirs):
    """`kvserve bench-parallel` smoke-sized: in-process, TP 2 and PP 2, each by actor calls (PP 2 with
    one and two steps in flight) and by the compiled graph (the same), the same tokens; under PP each
    stage's compute and wait per step (the last stage waits for the first)."""
    from benchmarks.parallel import bench_parallel, format_parallel_report, parse_config

    assert [parse_config(t) for t in ("1x1", "2x1", "1x2", "2")] == [(1, 1), (2, 1), (1, 2), (2, 1)]
    report = bench_parallel(model_dirs["llama"], [(1, 1), (2, 1), (1, 2)], ["remote", "compiled"], num_requests=4,
                            prompt_len=16, output_len=4, in_flight=(1, 0))
    assert report["same_tokens"] is True
    assert [(r["tp"], r["pp"], r["dispatch"], r["in_flight"]) for r in report["runs"]] == [
        (1, 1, "in-process", 1), (2, 1, "remote", 1), (2, 1, "compiled", 1), (1, 2, "remote", 1), (1, 2, "remote", 2),
        (1, 2, "compiled", 1), (1, 2, "compiled", 2)]
    for run in report["runs"]:
        assert run["startup_s"] > 0 and run["output_tokens_per_s"] > 0
        assert 0 <= run["dispatch_us_median"] <= run["dispatch_us_p90"]
        assert ("stage_compute_ms" in run) == (run["pp"] > 1)
        if run["pp"] > 1:
            compute, wait = run["stage_compute_ms"], run["stage_wait_ms"]
            assert len(compute) == len(wait) == 2 and min(compute) > 0
            assert wait[0] == 0 and wait[1] > 0  # the first stage waits for nothing; the last for the first
    assert "| 1 | 2 | compiled | 1 |" in format_parallel_report(report)
    assert "| 1 | 2 | compiled | 2 |" in format_parallel_report(report)


def test_a_stages_ranks_take_bundles_of_one_node():
    from cluster.placement import stage_bundles

    assert stage_bundles(["a", "a", "b", "b"], tp=2, pp=2) == [0, 1, 2, 3]
    assert stage_bundles(["a", "b", "a", "b"], tp=2, pp=2) == [0, 2, 1, 3]  # interleaved by Ray
    assert stage_bundles(["a", "b", "b", "a", "c", "c"], tp=2, pp=3) == [0, 3, 1, 2, 4, 5]
    assert stage_bundles(["a", "a", "a", "a"], tp=2, pp=2) == [0, 1, 2, 3]
    # no node holds a whole stage: the lowest bundles left, the stage across nodes
    assert stage_bundles(["a", "b", "c", "a"], tp=2, pp=2) == [0, 3, 1, 2]
    assert stage_bundles(["a", "b", "c", "d"], tp=2, pp=2) == [0, 1, 2, 3]
    assert sorted(stage_bundles(["x", "y", "x", "y", "y", "x"], tp=3, pp=2)) == list(range(6))
    assert stage_bundles(["x", "y", "x", "y", "y", "x"], tp=3, pp=2) == [0, 2, 5, 1, 3, 4]


def test_two_steps_in_flight_by_default_one_when_asked_through_the_compiled_graph(ray_cluster, five_layers):
    """PP 2 through the compiled graph's channels keeps a step in each stage (the default, one per
    stage); batches_in_flight=1 sends one at a time. The tokens are the same, exact against Hugging
    Face, and every block comes back. (By actor calls: the PP 2 test above.)"""
    path, oracle = five_layers
    prompts = make_prompts(path)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = {}
    for in_flight in (None, 1):
        with LLM(model=path, pipeline_parallel_size=2, batches_in_flight=in_flight, num_kv_blocks=256,
                 tp_dispatch="compiled") as llm:
            counts = count_in_flight(llm)
            runs[in_flight] = generate(llm, prompts, params)
            stats = llm.stats()
        assert max(counts, default=1) == (in_flight or 2) and stats["num_blocks_in_use"] == 0
    assert runs[None] == runs[1]
    for prompt, out in zip(prompts, runs[None]):
        oracle.assert_greedy(prompt, out)
