"""Qwen3 and Phi-3 against Hugging Face transformers on tiny random checkpoints, through the paged KV
cache (prefill, decode, a mixed step with a cached prefix): at tp 1, 2 and 4 (threads standing in for
ranks; 4 ranks replicate the 2 KV heads), Phi-3's fused tensors cut per rank, its partial rotary under
LongRoPE with every sequence below the original length (short factors) and above it (long factors);
the Qwen3 and Phi-3 decoder stacks against their layers run one by one at 1, 2 and 3 threads; the
LongRoPE cache against transformers' rotary; and the configs that are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from tests.compiled import cpu_backend_or_skip
from tests.workers.test_decoder_stack import _model as stacked_model
from tests.workers.test_decoder_stack import _run as run_stack_scenario
from tests.workers.test_decoder_stack import assert_same_bits
from tests.workers.test_models import (
    VOCAB,
    Checkpoint,
    cached_builds,
    load_model,
    max_diff,
    run_scenario,
    saved_checkpoint,
)
from workers.layers import RotaryEmbedding
from workers.models import kv_cache_shape, resolve_architecture
from workers.models.phi3 import Phi3ForCausalLM
from workers.parallel_state import TPGroup

CPU = cpu_backend_or_skip()
MAX_POSITIONS = 128


PHI3_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)  # Phi3Config's defaults are past VOCAB


def longrope(original: int) -> dict:
    return dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                original_max_position_embeddings=original, short_factor=[1.0, 1.05, 1.1, 1.2, 1.3, 1.5],
                long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 9.0])


CONFIGS = {  # name -> (family, config kwargs); hidden 64, 4 heads, 2 KV heads
    # head_dim 32 where hidden / heads is 16, biases on q, k, v and o
    "qwen3": ("Qwen3", dict(head_dim=32, attention_bias=True)),
    # every sequence of SEQS (14 to 43 tokens) is below 64: short factors; above 8: long factors throughout
    "phi3_short": ("Phi3", dict(PHI3_IDS, original_max_position_embeddings=64, rope_parameters=longrope(64))),
    "phi3_long": ("Phi3", dict(PHI3_IDS, original_max_position_embeddings=8, rope_parameters=longrope(8))),
}


def build(name: str, path: Path) -> Checkpoint:
    family, kwargs = CONFIGS[name]
    config = getattr(transformers, f"{family}Config")(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS, initializer_range=0.1, attn_implementation="eager",
        **kwargs)
    torch.manual_seed(0)
    hf_model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    if family == "Qwen3":  # transformers initialises the q/k norms to ones: make them matter
        for layer in hf_model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.data.uniform_(0.5, 1.5)
    return saved_checkpoint(hf_model, path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return cached_builds(tmp_path_factory, build)


class LongRows(torch.nn.Module):
    """What the model runner does for a prompt past the original length: positions offset into the long rows."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids, positions, kv_caches, meta):
        return self.model(ids, positions + self.model.long_rope[1], kv_caches, meta)

    def compute_logits(self, hidden):
        return self.model.compute_logits(hidden)


def runnable(name: str, model: torch.nn.Module) -> torch.nn.Module:
    return LongRows(model) if name == "phi3_long" else model


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_hf_at_every_tp(name, tp_size, ckpt, tp_ranks):
    c = ckpt(name)
    per_rank = tp_ranks(tp_size, lambda tp: run_scenario(runnable(name, load_model(c, tp)), c.hf_config, tp))
    print(f"{name} tp={tp_size}: max |logits - HF| = {max_diff(per_rank[0], c):.2e}")
    assert all(logits is None for results in per_rank[1:] for step in results for *_, logits in step)


def test_phi3_long_and_short_rows_differ(ckpt):
    """The long factors change the logits (so the tests above tell the two rotations apart)."""
    c = ckpt("phi3_long")
    with torch.inference_mode():
        results = run_scenario(load_model(c, TPGroup()), c.hf_config, TPGroup())  # positions not offset
    with pytest.raises(AssertionError, match="differs from HF"):
        max_diff(results, c)


def test_shapes_and_per_rank_slices(ckpt, tp_ranks):
    qwen3, phi3 = ckpt("qwen3").hf_config, ckpt("phi3_short").hf_config
    assert kv_cache_shape(qwen3, 1) == (2, 2, 32, False) and kv_cache_shape(qwen3, 4) == (2, 1, 32, True)
    assert kv_cache_shape(phi3, 2) == (2, 1, 16, False)
    assert resolve_architecture(qwen3).__name__ == "Qwen3ForCausalLM"
    fused = ckpt("phi3_short").hf_model.model.layers[1]

    def rank_weights(tp):
        layer = load_model(ckpt("phi3_short"), tp).model.layers[1]
        return layer.self_attn.qkv_proj.weight.clone(), layer.mlp.gate_up_proj.weight.clone()

    q, k, v = fused.self_attn.qkv_proj.weight.data.split([64, 32, 32])
    gate, up = fused.mlp.gate_up_proj.weight.data.chunk(2)
    for rank, (qkv, gate_up) in enumerate(tp_ranks(4, rank_weights)):  # one query head, a copy of KV head rank // 2
        kv = slice(rank // 2 * 16, rank // 2 * 16 + 16)
        assert torch.equal(qkv, torch.cat([q[rank * 16:rank * 16 + 16], k[kv], v[kv]]))
        assert torch.equal(gate_up, torch.cat([gate[rank * 32:rank * 32 + 32], up[rank * 32:rank * 32 + 32]]))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("name", ["qwen3", "phi3_long"])
def test_decoder_stack_matches_the_layers_to_the_bit(name, threads, ckpt):
    c = ckpt(name)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            stacked = run_stack_scenario(runnable(name, stacked_model(c, True)), c)
            layered = run_stack_scenario(runnable(name, stacked_model(c, False)), c)
    finally:
        torch.set_num_threads(before)
    assert_same_bits(stacked, layered, name)
    max_diff(stacked, c)  # and both match HF


@pytest.mark.parametrize("arch", ["qwen3", "phi3"])
def test_every_preset_builds_a_config_the_model_takes(arch):
    """make-model's presets for both families are configs transformers accepts (Phi-3's validates the
    longrope factors' count) and the model classes parse."""
    from workers.model_builder import _CLASSES, PRESETS

    for preset, kwargs in PRESETS[arch].items():
        config = getattr(transformers, _CLASSES[arch][0])(**{"vocab_size": 4096, **kwargs})
        hf = {**config.to_dict(), "architectures": [_CLASSES[arch][1]]}
        args = resolve_architecture(hf).parse_config(hf)
        if arch == "qwen3":
            assert args.head_dim == 2 * args.hidden_size // args.num_heads, preset
        else:
            assert args.rope["rope_type"] == "longrope" and args.rope["original_max_position_embeddings"] == (
                args.max_position_embeddings // 8), preset


def test_longrope_cache_matches_transformers():
    """Rows [0, original) short, [original, max) long (position-based), [max, 2 max) long for every position;
    the attention factor sqrt(1 + ln(max / original) / ln(original)) on all of them; 12 of 16 dims rotated."""
    config = transformers.Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=MAX_POSITIONS,
                                     original_max_position_embeddings=32, rope_parameters=longrope(32))
    hf = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)

    def hf_rows(count: int) -> torch.Tensor:  # one forward over positions [0, count)
        cos, sin = hf(x, torch.arange(count)[None])
        return torch.cat((cos[0, :, :6], sin[0, :, :6]), -1)

    params = Phi3ForCausalLM.parse_config({**config.to_dict(), "architectures": ["Phi3ForCausalLM"]}).rope
    ours = RotaryEmbedding(16, MAX_POSITIONS, params, torch.device("cpu"), rotary_dim=12)
    cache = ours.cos_sin_cache
    assert cache.shape == (2 * MAX_POSITIONS, 12) and ours.long_rope == (32, MAX_POSITIONS)
    assert hf.attention_scaling == pytest.approx((1 + torch.log(torch.tensor(4.0)).item() / torch.log(
        torch.tensor(32.0)).item()) ** 0.5)
    short, long = hf_rows(32), hf_rows(MAX_POSITIONS)
    torch.testing.assert_close(cache[:32], short, atol=2e-6, rtol=0)
    torch.testing.assert_close(cache[32:MAX_POSITIONS], long[32:], atol=2e-6, rtol=0)
    torch.testing.assert_close(cache[MAX_POSITIONS:], long, atol=2e-6, rtol=0)
    assert (cache[:32] - long[:32]).abs().max() > 0.1


def phi3_config(**changes) -> dict:
    config = transformers.Phi3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=128, vocab_size=VOCAB, num_hidden_layers=1,
                                     max_position_embeddings=MAX_POSITIONS, original_max_position_embeddings=32,
                                     rope_parameters=longrope(32), **PHI3_IDS).to_dict()
    rope = {**config["rope_parameters"], **changes.pop("rope", {})}
    return {**config, "rope_parameters": rope, "architectures": ["Phi3ForCausalLM"], **changes}


@pytest.mark.parametrize("changes,message", [
    ({"rope": {"rope_type": "dynamic"}}, "rope type 'dynamic' is not supported"),
    ({"rope": {"short_factor": [1.0] * 8}}, "short_factor must hold rotary_dim / 2 = 6 values, not 8"),
    ({"rope": {"partial_rotary_factor": 0.5625}}, "partial_rotary_factor 0.5625 gives a rotary width of 9"),
    ({"rope": {"original_max_position_embeddings": None}, "original_max_position_embeddings": None},
     "longrope needs original_max_position_embeddings"),
])
def test_unsupported_configs_are_value_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        Phi3ForCausalLM(phi3_config(**changes), TPGroup(), torch.float32, torch.device("cpu"))


def test_phi3_su_and_default_rope_types():
    """Old configs' ``su`` is LongRoPE; ``default`` (Phi-3-mini-4k) rotates with no factors, still partially."""
    su = Phi3ForCausalLM(phi3_config(rope={"rope_type": "su"}), TPGroup(), torch.float32, torch.device("cpu"))
    assert su.long_rope == (32, MAX_POSITIONS)
    plain = Phi3ForCausalLM(phi3_config(rope={"rope_type": "default"}), TPGroup(), torch.float32, torch.device("cpu"))
    assert plain.long_rope is None
    assert plain.model.layers[0].self_attn.rotary_emb.cos_sin_cache.shape == (MAX_POSITIONS, 12)


def test_triton_rotary_reads_the_long_rows():
    """The Triton rotary (interpreter) over Phi-3's partial rotary at positions in both halves of the
    LongRoPE cache, as the torch rotary computes it (the e2e tests run the Triton path below 256 tokens)."""
    from kernels.rotary import apply_rotary_emb
    from kernels.triton import ops

    model = Phi3ForCausalLM(phi3_config(), TPGroup(), torch.float32, torch.device("cpu"))
    cache = model.model.layers[0].self_attn.rotary_emb.cos_sin_cache
    positions = torch.tensor([0, 31, 32, 127, MAX_POSITIONS, MAX_POSITIONS + 5, 2 * MAX_POSITIONS - 1])
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(7, 4 * 16, generator=gen), torch.randn(7, 2 * 16, generator=gen)
    want_q, want_k = apply_rotary_emb(q.view(7, 4, 16), k.view(7, 2, 16), positions, cache)
    got_q, got_k = ops.rotary_neox_(positions, q.clone(), k.clone(), cache, 16)
    torch.testing.assert_close(got_q, want_q.reshape(7, -1), atol=1e-6, rtol=0)
    torch.testing.assert_close(got_k, want_k.reshape(7, -1), atol=1e-6, rtol=0)
    assert torch.equal(got_q.view(7, 4, 16)[..., 12:], q.view(7, 4, 16)[..., 12:])  # 4 of 16 dims pass through


def test_phi3_legacy_config_reads_the_same():
    """transformers-4 checkpoints (Phi-3.5-mini, Phi-4-mini): ``rope_scaling`` with ``type``, and
    partial_rotary_factor, original_max_position_embeddings and rope_theta at the top level."""
    from engine.config import long_rope_threshold

    new = phi3_config()
    legacy = {k: v for k, v in new.items() if k != "rope_parameters"}
    rope = new["rope_parameters"]
    legacy.update(rope_scaling={"type": "longrope", "short_factor": rope["short_factor"],
                                "long_factor": rope["long_factor"]}, partial_rotary_factor=0.75, rope_theta=10000.0)
    assert legacy["original_max_position_embeddings"] == 32 and "original_max_position_embeddings" not in legacy[
        "rope_scaling"]
    models = [Phi3ForCausalLM(c, TPGroup(), torch.float32, torch.device("cpu")) for c in (new, legacy)]
    caches = [m.model.layers[0].self_attn.rotary_emb.cos_sin_cache for m in models]
    assert torch.equal(caches[0], caches[1]) and models[1].long_rope == (32, MAX_POSITIONS)
    assert long_rope_threshold(new) == long_rope_threshold(legacy) == 32
    assert long_rope_threshold({"rope_scaling": {"type": "yarn", "factor": 4.0}, "model_type": "llama"}) is None
