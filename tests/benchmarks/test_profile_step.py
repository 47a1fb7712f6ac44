"""`kvserve profile-step`: the phases of a decode step add up, and the attention in them is the one asked for."""

from __future__ import annotations

import pytest

from benchmarks.profile_step import PHASES, format_profile, profile_step


@pytest.mark.parametrize("backend,cascade,kv", [("cpu", True, "auto"), ("torch", False, "auto"), ("cpu", True, "int8")])
def test_profile_step_accounts_for_the_step(model_dirs, backend, cascade, kv):
    # the wrapped phases are the step: what none of them covers is small. A run that the OS preempted in
    # the few lines between phases (the suite runs beside other workers) says nothing about that, so the
    # bound must hold in one of three runs, not in every one
    for _ in range(3):
        result = profile_step(model_dirs["llama"], num_seqs=6, prompt_len=70, shared_prefix=48, steps=4, threads=1,
                              block_size=8, attention_backend=backend, cascade=cascade, kv_cache_dtype=kv)
        phases = result["phases_ms"]
        assert set(phases) == {*PHASES, "other"}
        assert all(phases[p] > 0 for p in PHASES)
        if abs(phases["other"]) < 0.25 * result["step_ms"]:
            break
    else:
        pytest.fail(f"uncovered step time {phases['other']:.2f} of {result['step_ms']:.2f} ms in three runs")
    ops = result["forward_ops_ms"]
    assert {"matmul", "attention"} <= set(ops)
    assert sum(ops.values()) == pytest.approx(phases["forward"] + phases["logits"], rel=0.02)
    assert result["attention_backend"] == backend
    # six sequences share 48 tokens: every profiled step (and the steps before them) attends them once
    assert (result["cascade_steps"] >= 8) == cascade
    text = format_profile(result)
    assert "outside the matrix products" in text and f"attention backend {backend}, KV {kv}" in text


def test_the_start_of_many_long_prompts_is_decoded_through(model_dirs, monkeypatch):
    """Every sequence keeps decoding while the later prompts are prefilled (a budget of batched tokens a
    step): with 6 prompts of 70 tokens and 16 tokens a step the start takes about 40 steps, more than the
    tokens a profile of one step used to give each sequence (18), which then finished and left the
    start waiting forever for all six to decode at once."""
    import benchmarks.profile_step as profile_module

    monkeypatch.setattr(profile_module, "MAX_BATCHED_TOKENS", 16)
    result = profile_step(model_dirs["llama"], num_seqs=6, prompt_len=70, shared_prefix=0, steps=1, threads=1,
                          block_size=8, attention_backend="torch", cascade=False)
    assert result["num_seqs"] == 6 and result["step_ms"] > 0


def test_a_pool_too_small_for_every_sequence_is_an_error_not_a_hang(model_dirs):
    import json
    from pathlib import Path

    config = json.loads((Path(model_dirs["llama"]) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    expected = r"a sequence finished \(length\) before all 6 were decoding: the KV pool must hold 6 x "
    with pytest.raises(RuntimeError, match=expected):
        # room for three of the six 70-token prompts: never all six at once
        profile_step(model_dirs["llama"], num_seqs=6, prompt_len=70, shared_prefix=0, steps=1, threads=1,
                     block_size=8, attention_backend="torch", cascade=False, kv_gib=250 * per_token / 2**30)


def test_the_products_the_precision_gives_are_named_and_measured_apart_from_the_fma_peak(model_dirs):
    """`--cpu-matmul-precision high` profiles the bf16x3 products where the CPU grants AMX tiles (float32
    elsewhere); their GFLOP/s are not set against float32's FMA peak, which does not bound them."""
    from kernels.cpu import load

    ops = load()
    want = "bf16x3" if ops is not None and ops.amx_usable() else "float32"
    result = profile_step(model_dirs["llama"], num_seqs=6, prompt_len=70, shared_prefix=0, steps=2, threads=1,
                          block_size=8, attention_backend="cpu" if ops is not None else "torch", cascade=False,
                          cpu_matmul_precision="high")
    assert result["cpu_matmul"] == want
    text = format_profile(result)
    assert f"linear products {want}" in text
    assert ("of the FMA peak" in text) == (want == "float32" and bool(result["fma_peak_per_core"]))


def test_a_shared_prefix_as_long_as_the_prompt_is_refused_before_anything_starts(model_dirs):
    """A prefix as long as the prompt or longer made prompts of prefix + 1 tokens (each sequence adds a
    token of its own): longer than asked, and past the prompt the engine refused them as longer than
    max_model_len, a message about neither flag. A negative prefix is refused too."""
    from cluster.cli import main

    for prefix in (100, 70, -1):
        with pytest.raises(ValueError, match=rf"^shared_prefix \({prefix}\) must be at least 0 and below prompt_len "
                                             r"\(70\), since each prompt adds at least one token of its own to the "
                                             r"shared prefix$"):
            profile_step(model_dirs["llama"], num_seqs=2, prompt_len=70, shared_prefix=prefix, steps=1, threads=1)
    with pytest.raises(SystemExit, match=r"^kvserve profile-step: --shared-prefix \(512\) must be at least 0 and "
                                         r"below --prompt-len \(288\), since each prompt adds at least one token of "
                                         r"its own to the shared prefix$"):
        main(["profile-step", "--model", model_dirs["llama"], "--prompt-len", "288"])


def test_the_experts_products_count_as_matrix_products():
    """Each token of a mixture-of-experts layer meets its top k experts' gate, up and down projections
    (3 x intermediate x hidden each) beside the router: those FLOPs, and the compiled experts' op's
    time, are the step's matrix products (left out, a MoE model's products read as the router's alone,
    and the experts' time as 'other torch ops')."""
    import torch
    from torch import nn

    from benchmarks.profile_step import _linear_flops, _op_family
    from workers.layers.moe import FusedMoE
    from workers.parallel_state import TPGroup

    experts, top_k, hidden, inter, rows = 6, 2, 40, 56, 5
    model = nn.Sequential(FusedMoE(experts, top_k, hidden, inter, True, "silu", TPGroup(), torch.float32,
                                   torch.device("cpu")))
    # the router (experts x hidden) and, per token, top_k experts of 2 x inter x hidden then hidden x inter
    assert _linear_flops(model, rows) == 2 * rows * (experts * hidden + top_k * 3 * inter * hidden)
    assert _op_family("kvserve_cpu::moe_experts", "cpu") == "matmul"
    assert _op_family("kvserve_cpu::linear", "cpu") == "matmul"
    # the router's softmax on the compiled backend is not attention; under the torch backend the
    # attention's own softmax is
    assert _op_family("aten::_softmax", "cpu") == "other torch ops"
    assert _op_family("aten::_softmax", "torch") == "attention"
    assert _op_family("kvserve_cpu::paged_attention", "cpu") == "attention"
