"""Pipeline parallelism for OPT and for Gemma 2 / Gemma 3 (with their hybrid KV layout): each stage
builds and reads only its share of the checkpoint (OPT's learned positions and ``project_in`` on the
first stage, its final norm and ``project_out`` on the last, the tied embedding on both ends); each
stage's KV pool holds the tensor pairs of its layers in the whole model's layout while the block ids,
block tables and window pages stay the scheduler's; and over Ray rank actors at PP 2 the tokens of
PP 1, exact against Hugging Face by teacher forcing, with prompts longer than the window, chunked
prefill and prefix-cache hits (Gemma 3 with a stage of local layers only)."""

from __future__ import annotations

import os

import pytest
import torch

from engine import LLM, SamplingParams, engine_config
from engine.kv_layout import KVLayout
from tests.conftest import HFOracle
from tests.e2e.prompts import corpus_ids
from tests.gemma_models import gemma_dir, gemma_oracle
from workers.model_builder import make_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# small steps (every prompt prefilled in chunks) over 16-token blocks; room for every request at once
CHUNKED = dict(block_size=16, max_model_len=320, max_num_batched_tokens=64, max_num_seqs=8, num_kv_blocks=256)


@pytest.fixture(scope="module")
def opt_dir(tmp_path_factory):
    return str(make_model("opt", "tiny", tmp_path_factory.mktemp("pp-opt") / "opt", seed=2))


@pytest.fixture(scope="module")
def built(opt_dir):
    """The checkpoints and oracles, made before the module's Ray cluster starts (as test_gemma_tp's)."""
    oracles = {"opt": HFOracle(opt_dir)}
    for arch in ("gemma2", "gemma3"):
        oracles[arch] = gemma_oracle(arch)
    return {"opt": opt_dir, "gemma2": gemma_dir("gemma2"), "gemma3": gemma_dir("gemma3")}, oracles


def long_prompts(path: str) -> list[list[int]]:
    """100-300 tokens (one short), longer than the Gemma presets' windows (48 / 40); the first two share
    160 tokens."""
    ids = corpus_ids(f"{path}/tokenizer.json")
    shared = list(ids[2000:2160])
    return [shared + list(ids[5000:5060]), shared + list(ids[6000:6100]), list(ids[3000:3130]),
            list(ids[8000:8300]), list(ids[100:107])]


def generate(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


def run(path, **kwargs):
    """The tokens of the prompts, then of the first two again (prefix-cache hits), and the stats."""
    prompts = long_prompts(path)
    with LLM(model=path, **CHUNKED, **kwargs) as llm:
        tokens = generate(llm, prompts)
        hits = llm.stats()["prefix_cache_hits"]
        again = generate(llm, prompts[:2])
        stats = llm.stats()
    assert again == tokens[:2]
    return tokens, stats, stats["prefix_cache_hits"] - hits


# --- configuration and stages, in this process -------------------------------------------------------

def test_opt_and_gemma_run_in_stages_with_their_layouts(built):
    from engine.parallel_config import PIPELINE_ARCHITECTURES
    from workers.models.registry import ARCHITECTURES

    assert set(ARCHITECTURES) == PIPELINE_ARCHITECTURES  # every architecture served runs in stages
    assert all(cls.supports_pipeline_parallel for cls in ARCHITECTURES.values())
    paths, _ = built
    assert engine_config(paths["opt"], pipeline_parallel_size=2).parallel.world_size == 2
    for arch, groups in (("gemma2", 1), ("gemma3", 5)):
        config = engine_config(paths[arch], pipeline_parallel_size=2, max_model_len=320)
        assert config.kv_layout().hybrid and config.kv_layout().num_window_groups == groups
        plain = engine_config(paths[arch], pipeline_parallel_size=2, disable_hybrid_kv_cache_manager=True)
        assert not plain.kv_layout().hybrid
    # a stage's pool holds the pairs its layers use: Gemma 2 (window, full, window, full: window layer j
    # and full layer j share pair j) halves between two stages; Gemma 3 (5 local, 1 global: one pair, five
    # window groups) keeps its one pair on every stage, its local-only stage included
    gemma2 = KVLayout(4, 48, (0, 2))
    assert [gemma2.pool_pairs(0, 2), gemma2.pool_pairs(2, 4), gemma2.pool_pairs(0, 4)] == [(0,), (1,), (0, 1)]
    gemma3 = KVLayout(6, 40, (0, 1, 2, 3, 4))
    assert [gemma3.pool_pairs(0, 4), gemma3.pool_pairs(4, 6)] == [(0,), (0,)]
    assert KVLayout.plain(5).pool_pairs(2, 4) == (2, 3)


def build_stages(path: str, stages: list[tuple[int, int]]):
    from engine.config import ModelConfig
    from workers.models.registry import resolve_architecture
    from workers.parallel_state import PipelineStage, TPGroup
    from workers.weight_loader import iter_checkpoint

    hf_config = ModelConfig.from_dir(path).hf_config
    models = []
    for rank, (start, end) in enumerate(stages):
        model = resolve_architecture(hf_config)(hf_config, TPGroup(), torch.float32, torch.device("cpu"),
                                                stage=PipelineStage(rank, len(stages), start, end, stages[-1][1]))
        model.load_weights(iter_checkpoint(path))
        models.append(model)
    return models


def checkpoint_name(arch: str, param: str) -> str:
    return param if param.startswith("lm_head.") or arch != "opt" else "model." + param


@pytest.mark.parametrize("arch, stages", [
    ("opt", [(0, 1), (1, 2)]), ("gemma2", [(0, 1), (1, 4)]), ("gemma3", [(0, 4), (4, 6)]),
])
def test_each_stage_holds_and_loads_only_its_share_of_the_checkpoint(built, arch, stages):
    """Each stage's parameters are exactly its layers' (equal to the checkpoint's tensors), the
    embedding on the first stage and, tied to the LM head, on the last; OPT's positions on the first
    only; the final norm on the last only."""
    from safetensors.torch import load_file

    path = built[0][arch]
    checkpoint = load_file(os.path.join(path, "model.safetensors"))
    models = build_stages(path, stages)
    held = []
    for model, (start, end) in zip(models, stages):
        params = dict(model.named_parameters())
        held.append(params)
        for name, param in params.items():
            if ".qkv_proj." in name or ".gate_up_proj." in name:
                continue  # fused here: the checkpoint's parts checked below
            assert torch.equal(param, checkpoint[checkpoint_name(arch, name)]), name
        prefix = "decoder.layers." if arch == "opt" else "model.layers."
        assert {int(n.split(".")[2]) for n in params if n.startswith(prefix)} == set(range(start, end))
        q = checkpoint[checkpoint_name(arch, f"{prefix}{start}.self_attn.q_proj.weight")]
        assert torch.equal(params[f"{prefix}{start}.self_attn.qkv_proj.weight"][:q.shape[0]], q)
    first, last = held[0], held[-1]
    if arch == "opt":
        assert {"decoder.embed_tokens.weight", "decoder.embed_positions.weight"} <= set(first)
        assert not any("final_layer_norm" in n and "layers" not in n for n in first)
        assert "decoder.embed_positions.weight" not in last and "decoder.final_layer_norm.weight" in last
        assert "decoder.embed_tokens.weight" in last  # the LM head is tied to it
        assert models[0].lm_head is None and models[-1].lm_head is not None
    else:
        assert "model.embed_tokens.weight" in first and "model.norm.weight" not in first
        assert {"model.embed_tokens.weight", "model.norm.weight"} <= set(last)
        assert models[0].lm_head is None and models[-1].lm_head is not None
        sliding = models[0].model.sliding
        assert sliding == ([True, False] * 2 if arch == "gemma2" else [True] * 5 + [False])


def test_opt_with_projections_keeps_project_in_first_and_project_out_last(tmp_path):
    """OPT-350m's shape (``word_embed_proj_dim`` < hidden): ``project_in`` goes with the embedding on
    the first stage, ``project_out`` with the final norm on the last, each stage loads its share, and the
    memory plan counts from the headers what each built stage holds."""
    import transformers

    from cluster.memory_plan import checkpoint_numels, stage_weight_elements

    config = transformers.OPTConfig(vocab_size=128, hidden_size=64, word_embed_proj_dim=32, num_hidden_layers=3,
                                    ffn_dim=96, num_attention_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.OPTForCausalLM(config).save_pretrained(tmp_path)
    stages = [(0, 1), (1, 3)]
    models = build_stages(str(tmp_path), stages)
    names = [set(dict(m.named_parameters())) for m in models]
    assert {"decoder.project_in.weight", "decoder.embed_positions.weight"} <= names[0]
    assert "decoder.project_out.weight" not in names[0]
    assert "decoder.project_out.weight" in names[1] and "decoder.project_in.weight" not in names[1]
    assert stage_weight_elements(checkpoint_numels(tmp_path), stages) == [
        sum(p.numel() for p in m.parameters()) for m in models]


# --- over Ray rank actors ------------------------------------------------------------------------------

def test_opt_pp2_matches_hf_and_pp1(built, ray_cluster):
    paths, oracles = built
    one, one_stats, _ = run(paths["opt"])
    tokens, stats, hits = run(paths["opt"], pipeline_parallel_size=2)
    assert tokens == one and hits > 0
    for prompt, out in zip(long_prompts(paths["opt"]), tokens):
        oracles["opt"].assert_greedy(prompt, out)
    assert stats["kv_pool_bytes_by_rank"] == [one_stats["kv_pool_bytes_per_rank"] // 2] * 2  # a layer each
    assert stats["num_blocks_in_use"] == 0


@pytest.mark.parametrize("arch, split", [("gemma2", None), ("gemma3", [4, 2])])
def test_gemma_pp2_on_the_hybrid_layout_matches_hf_and_pp1(built, ray_cluster, arch, split):
    """The window layers release their pages behind the window on every stage alike (the scheduler's
    window tables); Gemma 3's first stage has local layers only. Gemma 2's stages hold a pair each (half
    of one rank's pool), Gemma 3's the one pair on both."""
    paths, oracles = built
    path = paths[arch]
    one, one_stats, _ = run(path)
    tokens, stats, hits = run(path, pipeline_parallel_size=2, pipeline_layer_split=split)
    assert tokens == one and hits > 0
    for prompt, out in zip(long_prompts(path), tokens):
        oracles[arch].assert_greedy(prompt, out)
    assert stats["kv_window_groups"] == one_stats["kv_window_groups"] == (1 if arch == "gemma2" else 5)
    assert stats["num_blocks_in_use"] == 0 and stats["kv_window_pages_held"] == 0
    pool = one_stats["kv_pool_bytes_per_rank"]
    assert stats["kv_pool_bytes_by_rank"] == ([pool // 2] * 2 if arch == "gemma2" else [pool] * 2)


def test_gemma2_pp2_with_every_layer_kept_whole(built, ray_cluster):
    """disable_hybrid_kv_cache_manager=True under PP: the plain layout, each stage its two layers, the
    same tokens as the hybrid layout's."""
    paths, oracles = built
    path = paths["gemma2"]
    tokens, stats, hits = run(path, pipeline_parallel_size=2, disable_hybrid_kv_cache_manager=True)
    assert stats["kv_window_groups"] == 0 and hits > 0
    for prompt, out in zip(long_prompts(path), tokens):
        oracles["gemma2"].assert_greedy(prompt, out)
