"""Rope settings as transformers reads them: a top-level ``original_max_position_embeddings`` under
LongRoPE (checked against transformers' own longrope frequencies), LongRoPE refused on architectures
whose runner has no long-prompt offsets, and the linear-rope cache sized by the reachable positions
(Gemma 3 4B's, whose max_position_embeddings is already the extended length)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.config import LONG_ROPE_ARCHITECTURES, ModelConfig, long_rope_threshold
from workers.layers import RotaryEmbedding, rope_parameters
from workers.models import resolve_architecture
from workers.models.gemma import _gemma3_rope
from workers.models.llama import LlamaForCausalLM
from workers.models.registry import ARCHITECTURES

HEAD, ORIGINAL, MAX = 16, 64, 256
SHORT = [1.0 + 0.1 * i for i in range(HEAD // 2)]
LONG = [2.0 + 0.5 * i for i in range(HEAD // 2)]


def llama_longrope(**top):
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
            "num_attention_heads": 2, "num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 100,
            "max_position_embeddings": MAX, "rope_parameters": {
                "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT, "long_factor": LONG}, **top}


@pytest.mark.parametrize("model_type", ["llama", "phi3"])
def test_top_level_original_max_position_embeddings_is_taken_as_transformers_does(model_type):
    """A longrope config with original_max_position_embeddings at the top level only (before: KeyError for
    Llama), or in both places (the top level wins): transformers' rotary module of that model, built on
    that config, rotates every row of the cache as ours does."""
    from transformers import Phi3Config
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config_cls, rotary_cls = (Phi3Config, Phi3RotaryEmbedding) if model_type == "phi3" else \
        (LlamaConfig, LlamaRotaryEmbedding)
    top = {**llama_longrope(original_max_position_embeddings=ORIGINAL), "model_type": model_type}
    both = {**top, "rope_parameters": {**top["rope_parameters"], "original_max_position_embeddings": 128}}
    for cfg in (top, both):
        params = rope_parameters(cfg)
        assert params["original_max_position_embeddings"] == long_rope_threshold(cfg) == ORIGINAL
        rotary = RotaryEmbedding(HEAD, MAX, params, torch.device("cpu"))
        assert rotary.long_rope == (ORIGINAL, MAX) and rotary.cos_sin_cache.shape == (2 * MAX, HEAD)
        hf = rotary_cls(config_cls.from_dict({k: v for k, v in cfg.items() if k != "architectures"}))
        factor = math.sqrt(1 + math.log(MAX / ORIGINAL) / math.log(ORIGINAL))
        assert hf.attention_scaling == pytest.approx(factor)
        x, positions = torch.zeros(1, 1, HEAD), torch.arange(MAX)[None]
        hf_long = torch.cat(hf(x, positions), dim=-1)[0]  # a forward past the original length: long factors

        def cos_sin(rows):  # transformers' cat(cos, sin) repeats each frequency twice: keep one of each
            return torch.cat((rows[:, : HEAD // 2], rows[:, HEAD:HEAD + HEAD // 2]), dim=-1)

        cache = rotary.cos_sin_cache
        torch.testing.assert_close(cache[:ORIGINAL], cos_sin(torch.cat(hf(x, positions[:, :ORIGINAL]), -1)[0]),
                                   rtol=0, atol=1e-5)
        torch.testing.assert_close(cache[ORIGINAL:MAX], cos_sin(hf_long)[ORIGINAL:], rtol=0, atol=1e-5)
        torch.testing.assert_close(cache[MAX:], cos_sin(hf_long), rtol=0, atol=1e-5)


def write(tmp_path, cfg):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM"])
def test_longrope_without_long_prompt_offsets_is_a_value_error(arch, tmp_path):
    cfg = {**llama_longrope(original_max_position_embeddings=ORIGINAL), "architectures": [arch]}
    with pytest.raises(ValueError, match=f"^{arch} cannot serve LongRoPE"):
        ModelConfig.from_dir(write(tmp_path, cfg))


def test_gemma3_longrope_per_layer_type_is_a_value_error(tmp_path):
    longrope = {"rope_type": "longrope", "rope_theta": 1e6, "short_factor": SHORT, "long_factor": LONG,
                "original_max_position_embeddings": ORIGINAL}
    cfg = {**llama_longrope(), "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
           "rope_parameters": {"full_attention": longrope, "sliding_attention": {"rope_type": "default"}}}
    with pytest.raises(ValueError, match="^Gemma3ForCausalLM cannot serve LongRoPE"):
        ModelConfig.from_dir(write(tmp_path, cfg))


def test_longrope_architectures_are_those_with_long_prompt_offsets(tmp_path):
    assert LONG_ROPE_ARCHITECTURES <= set(ARCHITECTURES)
    for name, cls in ARCHITECTURES.items():
        assert (name in LONG_ROPE_ARCHITECTURES) == issubclass(cls, LlamaForCausalLM), name
    cfg = llama_longrope(original_max_position_embeddings=ORIGINAL)
    assert ModelConfig.from_dir(write(tmp_path, cfg)).long_rope_threshold == ORIGINAL
    assert resolve_architecture(cfg) is LlamaForCausalLM


# Gemma 3 4B's text config (google/gemma-3-4b-it): its max_position_embeddings is the extended length
GEMMA3_4B = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 256,
             "max_position_embeddings": 131072, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
             "rope_scaling": {"rope_type": "linear", "factor": 8.0}}


def test_linear_rope_cache_holds_the_reachable_positions_gemma3_4b():
    full, local = _gemma3_rope(GEMMA3_4B)
    assert full["rope_type"] == "linear" and local["rope_type"] == "default"
    rotary = RotaryEmbedding(256, GEMMA3_4B["max_position_embeddings"], full, torch.device("cpu"))
    cache = rotary.cos_sin_cache
    assert cache.shape == (131072, 256) and cache.dtype == torch.float32
    assert cache.numel() * cache.element_size() == 128 * 2**20  # not 8x that (1 GiB)
    # positions divided by the factor, as transformers' linear scaling computes
    inv = 1.0 / (1e6 ** (torch.arange(0, 256, 2, dtype=torch.float32) / 256)) / 8.0
    last = torch.outer(torch.tensor([131071.0]), inv)
    torch.testing.assert_close(cache[-1:], torch.cat((last.cos(), last.sin()), dim=-1), rtol=0, atol=1e-6)
