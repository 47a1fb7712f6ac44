"""Mixture-of-experts models (Mixtral; Qwen3-MoE with a dense layer among the sparse ones) as one compiled
layer stack (``kernels/cpu/decoder_stack.cpp``: the router, its softmax and top k, and the compiled experts
op inside the stack) against the same compiled ops run layer by layer: the same logits to the bit at 1, 2
and 3 threads, through prefill, decode and a mixed step with a shared-prefix group, in the engine's
default and deterministic orders; both against Hugging Face transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from tests.compiled import cpu_backend_or_skip
from tests.workers.test_decoder_stack import _model as stacked_model
from tests.workers.test_decoder_stack import _run as run_stack_scenario
from tests.workers.test_decoder_stack import assert_same_bits
from tests.workers.test_models import VOCAB, Checkpoint, cached_builds, load_model, max_diff, saved_checkpoint
from workers.layers.kernels import bind_cpu_kernels
from workers.layers.moe import FusedMoE
from workers.parallel_state import TPGroup

CPU = cpu_backend_or_skip()

CONFIGS = {  # name -> (family, config kwargs); hidden 64, 4 heads, 2 KV heads
    # 4 experts of 96 features, top 2, renormalised (Mixtral always)
    "mixtral": ("Mixtral", dict(num_hidden_layers=2, intermediate_size=96, num_local_experts=4,
                                num_experts_per_tok=2, sliding_window=None)),
    # 6 experts of 48 (panels padded), top 2 not renormalised, layer 1 a dense MLP of 128, q/k norms
    "qwen3_moe": ("Qwen3Moe", dict(num_hidden_layers=3, head_dim=32, intermediate_size=128, moe_intermediate_size=48,
                                   num_experts=6, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
                                   mlp_only_layers=[1])),
}


def build(name: str, path: Path) -> Checkpoint:
    family, kwargs = CONFIGS[name]
    config = getattr(transformers, f"{family}Config")(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
        initializer_range=0.1, attn_implementation="eager", **kwargs)
    torch.manual_seed(0)
    hf_model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():
        for module in hf_model.modules():
            gate = getattr(module, "gate", None)
            if isinstance(gate, torch.nn.Module) and hasattr(gate, "weight") and gate.weight.shape[0] in (4, 6):
                gate.weight.mul_(8.0)  # a decided router: no near-tie between experts for float error to flip
    return saved_checkpoint(hf_model, path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return cached_builds(tmp_path_factory, build)


class Deterministic(torch.nn.Module):
    """The model with every step's metadata in the engine's deterministic mode (fixed-order products and
    attention, as the runner sets ``meta.deterministic``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids, positions, kv_caches, meta):
        meta.deterministic = True
        return self.model(ids, positions, kv_caches, meta)

    def compute_logits(self, hidden):
        return self.model.compute_logits(hidden)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_moe_stack_matches_the_layers_to_the_bit(name, threads, ckpt):
    c = ckpt(name)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            stacked_model_ = stacked_model(c, True)
            stack = stacked_model_.model.stack
            # every sparse layer runs its experts in the stack; Qwen3-MoE's layer 1 its dense MLP
            want = [(2, 1, 96)] * 2 if name == "mixtral" else [(2, 0, 48), (0, 0, 0), (2, 0, 48)]
            assert [tuple(stack.moe[i:i + 3]) for i in range(0, len(stack.moe), 3)] == want
            stacked = run_stack_scenario(stacked_model_, c)
            layered = run_stack_scenario(stacked_model(c, False), c)
    finally:
        torch.set_num_threads(before)
    assert_same_bits(stacked, layered, name)
    max_diff(stacked, c)  # and both match HF


@pytest.mark.parametrize("name", list(CONFIGS))
def test_moe_stack_in_the_deterministic_order(name, ckpt):
    """Under ``meta.deterministic`` the stack's products (the router's among them) are the fixed-order
    ones the layers bound in that mode run."""
    c = ckpt(name)
    with torch.inference_mode():
        stacked = Deterministic(load_model(c, TPGroup()))
        bind_cpu_kernels(stacked.model, CPU.layer_ops, deterministic=True)
        layered = Deterministic(load_model(c, TPGroup()))
        bind_cpu_kernels(layered.model, CPU.layer_ops, deterministic=True)
        assert stacked.model.model.stack is not None
        layered.model.model.stack = None
        got_steps, want_steps = run_stack_scenario(stacked, c), run_stack_scenario(layered, c)
    assert_same_bits(got_steps, want_steps, name)
    max_diff(got_steps, c)


def test_experts_the_compiled_op_does_not_run_keep_the_layers(ckpt):
    """A mixture whose experts the compiled op does not hold (not packed for it: a non-SiLU activation
    or another dtype keeps plain torch) leaves the whole stack unbound."""
    c = ckpt("mixtral")
    model = load_model(c, TPGroup())
    for module in model.modules():
        if isinstance(module, FusedMoE):
            module.pack_for_cpu = lambda layer_ops, split=False: False  # as for experts it cannot take
    bind_cpu_kernels(model, CPU.layer_ops)
    assert model.model.stack is None
