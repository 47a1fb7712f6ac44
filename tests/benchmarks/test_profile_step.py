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
