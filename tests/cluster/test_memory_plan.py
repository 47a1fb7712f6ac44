"""What each rank reserves of a node's memory (cluster/memory_plan.py) and what placement does with it:
the weights counted from the checkpoint's headers equal what each built stage holds; a pool's and a host
tier's bytes as the settings give them; the bundles' fit checked per node; and on two Ray nodes whose
memory holds one rank each, PP 2 puts a stage on each (PACK would put both on one node by CPUs), gives
the tokens of one process, and a rank's peak resident memory stays within its reservation; PP 2 x TP 2
puts each stage's two ranks on a node of their own; a rank no node can hold is refused before start
with what it needs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cluster.memory_plan import (GIB, RANK_RUNTIME_BYTES, RankMemory, bundle_memory, checkpoint_numels,
                                 kv_bytes_per_block, memory_refusal, rank_memory, replicas_refusal,
                                 stage_weight_elements)
from cluster.placement import PlacementError, _fits, _packs
from engine import LLM, SamplingParams, engine_config
from engine.config import CPU_DEFAULT_KV_BYTES, CPU_DEFAULT_MAX_BLOCKS
from tests.e2e.prompts import test_prompts as make_prompts
from tests.gemma_models import gemma_dir
from workers.model_builder import make_model

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
MIB = 1 << 20


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("memplan")
    return {
        "llama": str(make_model("llama", "tiny", root / "llama", seed=1, num_layers=5)),  # untied LM head
        "qwen3": str(make_model("qwen3", "tiny", root / "qwen3", seed=1, num_layers=3)),  # tied to the embedding
        "mixtral": str(make_model("mixtral", "tiny", root / "mixtral", seed=1)),
        "phi3": str(make_model("phi3", "tiny", root / "phi3", seed=1)),  # fused qkv and gate_up in the checkpoint
        "opt": str(make_model("opt", "tiny", root / "opt", seed=1)),  # learned positions, tied LM head
        "gemma2": gemma_dir("gemma2"),  # tied LM head, window layers
        "gemma3": gemma_dir("gemma3"),
    }


def built_stage_elements(path: str, stages: list[tuple[int, int]]) -> list[int]:
    from engine.config import ModelConfig
    from workers.models.registry import resolve_architecture
    from workers.parallel_state import PipelineStage, TPGroup

    hf_config = ModelConfig.from_dir(path).hf_config
    held = []
    for s, (start, end) in enumerate(stages):
        stage = PipelineStage(s, len(stages), start, end, stages[-1][1]) if len(stages) > 1 else None
        model = resolve_architecture(hf_config)(hf_config, TPGroup(), torch.float32, torch.device("cpu"), stage=stage)
        held.append(sum(p.numel() for p in model.parameters()))
    return held


@pytest.mark.parametrize("arch, stages", [
    ("llama", [(0, 5)]), ("llama", [(0, 1), (1, 4), (4, 5)]), ("llama", [(0, 3), (3, 5)]),
    ("qwen3", [(0, 3)]), ("qwen3", [(0, 2), (2, 3)]), ("mixtral", [(0, 1), (1, 2)]), ("phi3", [(0, 1), (1, 2)]),
    ("opt", [(0, 1), (1, 2)]), ("gemma2", [(0, 1), (1, 4)]), ("gemma2", [(0, 2), (2, 4)]),
    ("gemma3", [(0, 4), (4, 6)]), ("gemma3", [(0, 2), (2, 4), (4, 6)]),
])
def test_the_headers_count_what_each_built_stage_holds(models, arch, stages):
    """Exactly: the embedding on the first stage (and on the last where the LM head is tied to it), each
    layer on its stage, the final norm and the LM head on the last."""
    numels = checkpoint_numels(models[arch])
    assert stage_weight_elements(numels, stages) == built_stage_elements(models[arch], stages)


def test_a_start_reads_each_header_once_and_a_rewritten_checkpoint_again(models, tmp_path, monkeypatch):
    """build_app plans the refusal, the replicas' fit and the bundle size, each over every rank: one read
    of each file's header serves them all; a checkpoint written again (another size) is read again."""
    import builtins
    import shutil

    import cluster.memory_plan as memory_plan

    path = tmp_path / "model"
    shutil.copytree(models["llama"], path)
    reads = []
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda file, *a, **k: (reads.append(str(file)), real_open(file, *a, **k))[1])
    config = engine_config(str(path), pipeline_parallel_size=2, num_kv_blocks=10)
    reads.clear()
    needs = rank_memory(config, use_gpu=False)
    memory_refusal(config, False, [64 * GIB])
    replicas_refusal(config, False, [64 * GIB], 3)
    bundle_memory(config, False, [64 * GIB])
    assert [r for r in reads if r.endswith(".safetensors")] == [str((path / "model.safetensors").resolve())]
    # another checkpoint at the same path: one layer fewer
    monkeypatch.setattr(builtins, "open", real_open)
    shutil.rmtree(path)
    make_model("llama", "tiny", path, seed=1, num_layers=4)
    fewer = rank_memory(engine_config(str(path), pipeline_parallel_size=2, num_kv_blocks=10), use_gpu=False)
    assert sum(n.weights for n in fewer) < sum(n.weights for n in needs)
    assert sum(n.weights for n in fewer) == sum(memory_plan.checkpoint_numels(path).values()) * 4


def test_a_ranks_pool_and_host_tier_as_the_settings_give_them(models):
    path = models["llama"]  # 5 layers, 2 KV heads of 16, float32
    block = kv_bytes_per_block(engine_config(path), 5, 4)
    assert block == 2 * 5 * 16 * 2 * 16 * 4
    config = engine_config(path, pipeline_parallel_size=2, num_kv_blocks=100, num_host_kv_blocks=7)
    needs = rank_memory(config, use_gpu=False)  # stages of 3 and 2 layers
    assert [n.kv for n in needs] == [100 * block * 3 // 5, 100 * block * 2 // 5]
    # host slots come from the largest stage (equal on every rank), each of this stage's block size
    assert [n.host_tier for n in needs] == [7 * block * 3 // 5, 7 * block * 2 // 5]
    # the runtime grows with a step's activations: the batched tokens times the widest rows
    assert all(n.runtime == needs[0].runtime > RANK_RUNTIME_BYTES for n in needs)
    double = rank_memory(engine_config(path, pipeline_parallel_size=2, num_kv_blocks=100,
                                       max_num_batched_tokens=4096), use_gpu=False)
    assert double[0].runtime - RANK_RUNTIME_BYTES == 2 * (needs[0].runtime - RANK_RUNTIME_BYTES)
    assert sum(n.weights for n in needs) == sum(checkpoint_numels(path).values()) * 4
    given = rank_memory(engine_config(path, kv_cache_memory_bytes=5 * MIB), use_gpu=False)
    assert [n.kv for n in given] == [5 * MIB]
    # the CPU default: 2 GiB, or its block cap where that is less (this model's blocks are small)
    assert rank_memory(engine_config(path), use_gpu=False)[0].kv == min(CPU_DEFAULT_KV_BYTES, CPU_DEFAULT_MAX_BLOCKS * block)
    qwen3 = engine_config(models["qwen3"])
    assert rank_memory(qwen3, use_gpu=False)[0].kv == min(CPU_DEFAULT_KV_BYTES, CPU_DEFAULT_MAX_BLOCKS * kv_bytes_per_block(qwen3, 3, 4))
    # tensor parallelism halves a rank's weights and (2 KV heads) its pool
    tp2 = rank_memory(engine_config(path, tensor_parallel_size=2, num_kv_blocks=100), use_gpu=False)
    assert len(tp2) == 2 and tp2[0].kv == 100 * block // 2
    assert tp2[0].weights == -(-sum(checkpoint_numels(path).values()) * 4 // 2)
    # a quantized pool: head_dim codes and a two-byte scale per row
    fp8 = rank_memory(engine_config(path, num_kv_blocks=100, kv_cache_dtype="int8"), use_gpu=False)
    assert fp8[0].kv == 100 * 2 * 5 * 16 * 2 * (16 + 2)
    # the bf16x3 product (cpu_matmul_precision "high") adds its split copy of a step's rows: 4 bytes per
    # batched token and input of the widest linear (this model's MLP down projection)
    hf = engine_config(path).model.hf_config
    widest = max(hf["hidden_size"], hf["intermediate_size"], hf["num_attention_heads"] * (hf.get("head_dim") or 0))
    assert widest == hf["intermediate_size"]
    plain = rank_memory(engine_config(path, num_kv_blocks=100), use_gpu=False)[0]
    high = rank_memory(engine_config(path, num_kv_blocks=100, cpu_matmul_precision="high"), use_gpu=False)[0]
    tokens = engine_config(path).scheduler.max_num_batched_tokens
    assert high.runtime - plain.runtime == tokens * widest * 4
    # deterministic mode splits nothing
    assert rank_memory(engine_config(path, num_kv_blocks=100, cpu_matmul_precision="high", deterministic=True),
                       use_gpu=False)[0].runtime == plain.runtime
    # on a GPU the weights and the pool are device memory: the rank reserves its runtime (and host tier)
    assert rank_memory(config, use_gpu=True)[0] == RankMemory(weights=0, kv=0, host_tier=7 * 2 * 3 * 16 * 2 * 16 * 2)


def test_a_rank_no_node_can_hold_is_refused_with_what_it_needs(models):
    config = engine_config(models["llama"], pipeline_parallel_size=2, kv_cache_memory_bytes=GIB,
                           placement_strategy="PACK")
    need = bundle_memory(config, use_gpu=False)
    assert memory_refusal(config, False, [need, need]) is None
    assert memory_refusal(config, False, None) is None  # an unknown cluster: nothing is checked
    rank0 = rank_memory(config, False)[0]
    assert memory_refusal(config, False, [GIB, 1.5 * GIB]) == (
        f"rank 0 (stage 0 of 2) needs {rank0.total / GIB:.2f} GiB (weights {rank0.weights / GIB:.2f}, KV pool 1.00, "
        f"runtime {rank0.runtime / GIB:.2f}) of memory but the largest Ray node has 1.50 GiB: raise pipeline_parallel_size or "
        f"tensor_parallel_size, lower kv_cache_memory_bytes, or add larger nodes")
    tp2 = engine_config(models["llama"], tensor_parallel_size=2, kv_cache_memory_bytes=GIB, placement_strategy="PACK")
    assert memory_refusal(tp2, False, [GIB]).startswith("rank 0 of 2 needs ")
    whole = engine_config(models["llama"], kv_cache_memory_bytes=GIB)
    assert memory_refusal(whole, False, [GIB]).startswith("the engine needs ")
    # STRICT_PACK (the default) puts the whole group on one node: each rank fitting a node is not enough
    packed = engine_config(models["llama"], pipeline_parallel_size=2, kv_cache_memory_bytes=GIB)
    assert memory_refusal(packed, False, [2 * need]) is None
    assert memory_refusal(packed, False, [1.5 * need, 1.5 * need]) == (
        f"placement_strategy STRICT_PACK puts the 2 ranks on one node, which needs {2 * need / GIB:.2f} GiB of "
        f"memory, but the largest Ray node has {1.5 * need / GIB:.2f} GiB: use placement_strategy PACK or SPREAD, "
        f"lower kv_cache_memory_bytes, or add larger nodes")
    # a deployment's most replicas: every rank of each in the cluster's memory
    assert replicas_refusal(config, False, [2 * need, 2 * need], 2) is None
    assert replicas_refusal(config, False, None, 9) is None
    assert replicas_refusal(config, False, [2 * need, 2 * need], 3) == (
        f"3 replicas need {6 * need / GIB:.2f} GiB of memory for their engines but the Ray cluster has "
        f"{4 * need / GIB:.2f} GiB: lower num_replicas / max_replicas, lower kv_cache_memory_bytes, or add nodes")
    assert replicas_refusal(config, False, [need], 1) == (
        f"the replica needs {2 * need / GIB:.2f} GiB of memory for its engine but the Ray cluster has "
        f"{need / GIB:.2f} GiB: lower kv_cache_memory_bytes, or add nodes")


def test_the_default_pool_takes_at_most_a_quarter_of_the_largest_node(models):
    """As a rank takes at most a quarter of the memory free at its start: a small node still holds a rank
    whose pool size nobody gave (an 8 GiB machine's Ray memory is about 4 GiB)."""
    config = engine_config(models["qwen3"])
    block = kv_bytes_per_block(config, 3, 4)
    assert rank_memory(config, False, [64 * GIB])[0].kv == min(CPU_DEFAULT_KV_BYTES, CPU_DEFAULT_MAX_BLOCKS * block)
    assert CPU_DEFAULT_MAX_BLOCKS * block > GIB // 2  # (the block cap is not what binds below)
    assert rank_memory(config, False, [GIB, 2 * GIB])[0].kv == GIB // 2
    assert rank_memory(config, False, [GIB])[0].kv == GIB // 4
    tp2 = engine_config(models["qwen3"], tensor_parallel_size=2)
    assert memory_refusal(tp2, False, [4.2 * GIB]) is None  # two ranks of 1.05 + 0.75 GiB and their weights
    # a size that was given is reserved whatever the nodes
    assert rank_memory(engine_config(models["qwen3"], kv_cache_memory_bytes=3 * GIB), False, [GIB])[0].kv == 3 * GIB


def test_bundles_are_checked_against_each_node(monkeypatch):
    import ray

    def nodes(*memories):
        monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 4.0, "memory": m * GIB}}
                                                   for m in memories])

    rank = {"CPU": 1.0, "memory": 3.0 * GIB}
    assert _packs([rank, rank], [{"CPU": 4, "memory": 4 * GIB}] * 2)
    assert not _packs([rank, rank], [{"CPU": 4, "memory": 5 * GIB}, {"CPU": 4, "memory": 2 * GIB}])
    assert _packs([rank, rank, {"CPU": 1.0, "memory": 1.0 * GIB}], [{"CPU": 4, "memory": 4 * GIB}] * 2)
    assert not _packs([rank] * 3, [{"CPU": 4, "memory": 5 * GIB}] * 2)  # the totals (9 <= 10) would allow it
    nodes(4, 4)
    assert _fits([rank, rank], "PACK") is None and _fits([rank, rank], "STRICT_SPREAD") is None
    nodes(5, 5)
    assert _fits([rank] * 3, "SPREAD").startswith("no assignment of the bundles to nodes fits")
    nodes(4, 4)
    assert _fits([rank, rank], "STRICT_PACK") == (
        "STRICT_PACK needs one node with CPU 2, memory 6.00 GiB, the largest has CPU 4, memory 4.00 GiB "
        "(use placement_strategy PACK or SPREAD for multi-node)")
    nodes(1)
    assert _fits([rank, rank], "PACK") == "memory: need 6.00 GiB, cluster has 1.00 GiB"


def test_a_local_cluster_to_be_started_is_given_the_memory_ray_will_give_it(monkeypatch):
    """Before `serve run` starts its local Ray, the app is checked against the ``memory`` resource Ray will
    give this machine: its available memory (as Ray estimates it, cgroup limits included) less the object
    store's share of that, never a share of the total (which left nothing on a machine with less than 30%
    of its memory free, and every app refused)."""
    import ray
    import ray._private.services as services
    import ray._private.utils as ray_utils
    from ray._private.resource_and_label_spec import ResourceAndLabelSpec

    from cluster.reservations import cluster_memory

    if ray.is_initialized():
        pytest.skip("needs no Ray in this process")
    monkeypatch.setattr(services, "canonicalize_bootstrap_address", lambda address: None)  # no cluster to join
    for available in (2 * GIB, 8 * GIB):  # 2 GiB: far below 30% of this machine's total
        monkeypatch.setattr(ray_utils, "estimate_available_memory", lambda: available)
        spec = ResourceAndLabelSpec()
        spec._resolve_memory_resources()  # what a local Ray started now would give its node
        assert cluster_memory() == [pytest.approx(spec.memory)] and spec.memory > 0.5 * available


PP2_KV = 256 * MIB  # the PP 2 engine's pool per rank; the PP 2 x TP 2 one's is PP2X2_KV
PP2X2_KV = 16 * MIB


def rank_need(path: str, **settings) -> int:
    return bundle_memory(engine_config(path, **settings), use_gpu=False)


@pytest.fixture(scope="module")
def small_nodes(models):
    """Two Ray nodes of 4 CPUs whose memory holds one rank of the llama at PP 2 (not two), and two ranks
    of it at PP 2 x TP 2 (not three): by CPUs one node would take either engine whole."""
    import ray
    from ray.cluster_utils import Cluster

    pp2 = rank_need(models["llama"], pipeline_parallel_size=2, kv_cache_memory_bytes=PP2_KV)
    pp2x2 = rank_need(models["llama"], pipeline_parallel_size=2, tensor_parallel_size=2,
                      kv_cache_memory_bytes=PP2X2_KV)
    low, high = max(pp2, 2 * pp2x2), min(2 * pp2, 3 * pp2x2)
    assert low < high, (pp2, pp2x2)  # the sizes above leave a window
    memory = (low + high) // 2
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "memory": memory})
    cluster.add_node(num_cpus=4, memory=memory)
    ray.init(address=cluster.address, log_to_driver=False)
    yield memory
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def one_process(models):
    """The llama's prompts and their greedy tokens from one process (no Ray)."""
    path = models["llama"]
    prompts = [{"prompt_token_ids": p} for p in make_prompts(path)]
    with LLM(model=path, kv_cache_memory_bytes=64 * MIB) as llm1:
        return prompts, [o.outputs[0].token_ids for o in llm1.generate(prompts, PARAMS)]


def test_pp2_takes_a_node_per_stage_where_one_node_holds_one_rank(small_nodes, models, one_process):
    """PACK puts bundles on as few nodes as fit: by CPUs one node would take both ranks, by memory only
    one. The tokens equal one process's; each rank's peak resident memory is within its reservation."""
    path = models["llama"]
    prompts, expected = one_process
    with LLM(model=path, pipeline_parallel_size=2, placement_strategy="PACK", kv_cache_memory_bytes=PP2_KV) as llm:
        nodes = llm.stats()["worker_nodes"]
        assert len(set(nodes)) == 2, nodes
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)] == expected
        needs = rank_memory(dataclasses.replace(llm.core.config, device="cpu"), use_gpu=False)
        for pid, need in zip(llm.core.executor.worker_pids(), needs):
            with open(f"/proc/{pid}/status") as f:
                peak = int(next(line for line in f if line.startswith("VmHWM")).split()[1]) * 1024
            assert peak <= need.total, (pid, peak, need)


def test_pp2_x_tp2_puts_each_stage_on_a_node_of_its_own(small_nodes, models, one_process):
    """Four ranks, two per node by memory: each stage's two ranks share a node (its all-reduces stay
    there) and the activations cross between the nodes; the tokens of one process."""
    path = models["llama"]
    prompts, expected = one_process
    with LLM(model=path, pipeline_parallel_size=2, tensor_parallel_size=2, placement_strategy="PACK",
             kv_cache_memory_bytes=PP2X2_KV) as llm:
        nodes = llm.stats()["worker_nodes"]  # rank order: stage 0's two ranks, then stage 1's
        assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2], nodes
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)] == expected


def test_ranks_no_node_can_hold_are_refused_before_start(small_nodes, models):
    path = models["llama"]
    with pytest.raises(PlacementError, match=r"^rank 0 \(stage 0 of 2\) needs .* but the largest Ray node has "):
        LLM(model=path, pipeline_parallel_size=2, placement_strategy="PACK", kv_cache_memory_bytes=small_nodes)
    # two ranks on one node (STRICT_PACK) need more than one node has, though each fits
    assert rank_need(path, tensor_parallel_size=2, kv_cache_memory_bytes=PP2_KV) < small_nodes < 2 * rank_need(
        path, tensor_parallel_size=2, kv_cache_memory_bytes=PP2_KV)
    with pytest.raises(PlacementError, match=r"^placement_strategy STRICT_PACK puts the 2 ranks on one node, which needs "):
        LLM(model=path, tensor_parallel_size=2, kv_cache_memory_bytes=PP2_KV)
