"""The Gemma model classes' configuration handling without an engine: the KV pool geometry at head
size 256, contexts not capped to the window (Mistral's still are), each layer's window, rotary and
soft-cap as transformers reads them (old- and new-style Gemma 3 rope settings alike), the presets,
and unsupported settings refused in one sentence."""

from __future__ import annotations

import json

import pytest
import torch

from engine.config import ModelConfig
from workers.model_builder import PRESETS, add_make_model_arguments
from workers.models import Gemma2ForCausalLM, Gemma3ForCausalLM, kv_cache_shape, resolve_architecture
from workers.models.gemma import _gemma3_rope
from workers.parallel_state import TPGroup

GEMMA2 = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 256, "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 256, "max_position_embeddings": 8192, "sliding_window": 48, "query_pre_attn_scalar": 64,
          "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "tie_word_embeddings": True}
GEMMA3_OLD = {**GEMMA2, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 7,
              "head_dim": 32, "rope_parameters": None, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window_pattern": 6}


def build(cfg, tp=TPGroup(0, 1)):
    return resolve_architecture(cfg)(cfg, tp, torch.float32, torch.device("cpu"))


def test_kv_pool_geometry_at_head_size_256():
    assert [kv_cache_shape(GEMMA2, tp) for tp in (1, 2, 4)] == [(4, 2, 256, False), (4, 1, 256, False),
                                                               (4, 1, 256, True)]


def test_contexts_are_not_capped_to_an_implemented_window(tmp_path):
    for name, cfg in (("gemma2", GEMMA2), ("gemma3", GEMMA3_OLD)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        assert ModelConfig.from_dir(tmp_path / name).max_model_len == 8192
        assert ModelConfig.from_dir(tmp_path / name, max_model_len=5000).max_model_len == 5000
    mistral = {**GEMMA2, "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    (tmp_path / "mistral").mkdir()
    (tmp_path / "mistral" / "config.json").write_text(json.dumps(mistral))
    assert ModelConfig.from_dir(tmp_path / "mistral").max_model_len == 4096  # attended fully: capped
    with pytest.raises(ValueError, match="sliding window of 4096"):
        ModelConfig.from_dir(tmp_path / "mistral", max_model_len=5000)


def test_gemma2_layers():
    model = build(GEMMA2)
    assert isinstance(model, Gemma2ForCausalLM) and not isinstance(model, Gemma3ForCausalLM)
    attn = [layer.self_attn.attn for layer in model.model.layers]
    assert [a.window for a in attn] == [48, 0, 48, 0]  # every other layer, from the first
    assert {a.softcap for a in attn} == {50.0} and {a.scale for a in attn} == {64 ** -0.5}
    assert model.final_softcap == 30.0 and model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.embed_scale == float(torch.tensor(8.0))
    assert all(layer.self_attn.q_norm is None for layer in model.model.layers)


def test_gemma3_layers_old_and_new_rope_settings():
    old = build(GEMMA3_OLD)
    new_cfg = {**GEMMA3_OLD, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    assert _gemma3_rope(GEMMA3_OLD) == _gemma3_rope(new_cfg)
    layers = build(new_cfg).model.layers
    assert [layer.self_attn.attn.window for layer in layers] == [48, 48, 48, 48, 48, 0, 48]  # five local per global
    assert {layer.self_attn.attn.softcap for layer in layers} == {0.0}  # HF's Gemma 3 attention ignores the cap
    assert layers[0].self_attn.q_norm is not None and layers[0].self_attn.k_norm.weight.shape == (32,)
    local, glob = layers[0].self_attn.rotary_emb, layers[5].self_attn.rotary_emb
    inv = 1.0 / (1e4 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))
    assert torch.equal(local.cos_sin_cache[7, :16], torch.cos(7 * inv))
    inv_global = 1.0 / (1e6 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32)) / 8.0
    assert torch.allclose(glob.cos_sin_cache[7, :16], torch.cos(7 * inv_global))
    assert old.model.layers[5].self_attn.rotary_emb.cos_sin_cache.shape == glob.cos_sin_cache.shape


@pytest.mark.parametrize("change,message", [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention is not supported"),
    ({"tie_word_embeddings": False}, "untied lm_head"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "for each of the 4 layers"),
    ({"sliding_window": None}, "need sliding_window >= 1"),
])
def test_unsupported_settings_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        build({**GEMMA2, **change})


def test_make_model_presets():
    import argparse

    parser = argparse.ArgumentParser()
    add_make_model_arguments(parser)
    for arch in ("gemma2", "gemma3"):
        args = parser.parse_args(["--arch", arch, "--preset", "tiny", "--out", "x"])
        assert args.arch == arch and set(PRESETS[arch]) == {"tiny", "small"}
    assert PRESETS["gemma2"]["tiny"]["head_dim"] == 256
    assert PRESETS["gemma3"]["tiny"]["sliding_window"] < 500  # the suite's longest prompt is 500 tokens
