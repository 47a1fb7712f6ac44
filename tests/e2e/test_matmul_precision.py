"""``cpu_matmul_precision`` through the engine: "high" runs the linear layers, and mixture-of-experts
models' experts, as bf16x3 products on AMX tiles where the CPU grants them (stats say which), within a
measured bound of Hugging Face's float32 logprobs under teacher forcing; "highest" and deterministic mode
keep the float32 products; a wrong value is refused by the engine and by the app's arguments."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from engine import LLM, SamplingParams
from kernels.cpu import load
from serve_app import AppArgs
from tests.e2e.prompts import test_prompts as make_prompts

ARCHS = ("llama", "qwen2")
OPS = load()
AMX = OPS is not None and OPS.amx_usable()
# The largest |logprob - HF's| of a prompt token over 2,648 positions (both chunk sizes): with bf16x3
# products 2.5e-4 (llama tiny) and 1.6e-4 (qwen2 tiny), with float32 products 6.7e-6 and 2.9e-6 (on a
# Sapphire Rapids VM); the bounds are 2x and 3x those.
TOL_HIGH = 5e-4
TOL_FLOAT32 = 2e-5


def _teacher_forced(model_dir: str, oracle, inspect=None, **engine) -> tuple[float, list, dict]:
    """The worst |logprob - HF's| over the prompts' positions (one prefill, then 64-token chunks), the
    engine's prompt logprobs and its stats; ``inspect(llm)`` is called on each engine."""
    prompts = make_prompts(model_dir)[1:]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    worst, logprobs = 0.0, []
    for chunk in (2048, 64):
        with LLM(model=model_dir, attention_backend="cpu", block_size=16, max_num_batched_tokens=chunk,
                 enable_prefix_caching=False, **engine) as llm:
            if inspect is not None:
                inspect(llm)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            stats = llm.stats()
        for prompt, out in zip(prompts, outs):
            ref = oracle.log_softmax(prompt)
            for pos in range(1, len(prompt)):
                got = out.prompt_logprobs[pos][prompt[pos]][0]
                logprobs.append(got)
                worst = max(worst, abs(got - float(ref[pos - 1, prompt[pos]])))
    return worst, logprobs, stats


@pytest.mark.parametrize("arch", ARCHS)
def test_high_precision_stays_within_its_measured_error(model_dirs, hf_oracle, arch):
    high, high_logprobs, stats = _teacher_forced(model_dirs[arch], hf_oracle(arch), cpu_matmul_precision="high")
    assert stats["cpu_matmul"] == ("bf16x3" if AMX else "float32")
    assert high <= TOL_HIGH
    highest, highest_logprobs, stats = _teacher_forced(model_dirs[arch], hf_oracle(arch))
    assert stats["cpu_matmul"] == "float32" and highest <= TOL_FLOAT32
    if AMX:  # the products really changed
        assert high_logprobs != highest_logprobs


# the mixture-of-experts checkpoints: Mixtral's tiny preset (hidden 64, experts of 48 features: gate|up
# split, down packed) and Qwen3-MoE's with experts of 96 (both split; its second layer is a dense MLP).
# Measured (Sapphire Rapids VM): worst |logprob - HF's| 1.6e-4 and 1.4e-4 under "high", 2.9e-6 under
# "highest": within TOL_HIGH as the dense models are.
MOE_EXPERT_WIDTHS = {"mixtral": 48, "qwen3_moe": 96}


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    from workers.model_builder import PRESETS, make_model

    root = tmp_path_factory.mktemp("moe-precision")
    dirs = {}
    for arch, width in MOE_EXPERT_WIDTHS.items():
        key = "intermediate_size" if arch == "mixtral" else "moe_intermediate_size"
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(PRESETS[arch]["tiny"], key, width)
            dirs[arch] = str(make_model(arch, "tiny", root / f"{arch}-tiny", seed=0))
    return dirs


@pytest.mark.parametrize("arch", list(MOE_EXPERT_WIDTHS))
def test_high_precision_splits_the_experts_within_the_dense_bound(moe_dirs, arch):
    """A Mixtral and a Qwen3-MoE under "high": the experts' weights are split where 32 divides their
    inputs (the stats say bf16x3), and the prompt logprobs stay within the dense models' bound of Hugging
    Face's under teacher forcing. Without AMX tiles: packed, float32."""
    from tests.conftest import HFOracle

    def experts_laid_out(llm) -> None:
        model = llm.core.executor.worker.runner.model
        layers = [m for m in model.modules() if type(m).__name__ == "FusedMoE"]
        assert layers and all(m.cpu_experts is not None for m in layers)
        for layer in layers:
            assert layer.w13_weight.dim() == (5 if AMX else 4)  # hidden 64
            assert layer.w2_weight.dim() == (5 if AMX and MOE_EXPERT_WIDTHS[arch] % 32 == 0 else 4)

    worst, _, stats = _teacher_forced(moe_dirs[arch], HFOracle(moe_dirs[arch]), inspect=experts_laid_out,
                                      cpu_matmul_precision="high")
    assert stats["cpu_matmul"] == ("bf16x3" if AMX else "float32")
    assert worst <= TOL_HIGH


def test_deterministic_mode_keeps_float32_products(model_dirs):
    prompt = make_prompts(model_dirs["llama"])[5]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = []
    for precision in ("high", "highest"):
        with LLM(model=model_dirs["llama"], deterministic=True, cpu_matmul_precision=precision) as llm:
            assert llm.stats()["cpu_matmul"] == "float32"
            outs.append(llm.generate({"prompt_token_ids": prompt}, greedy)[0].outputs[0])
    assert outs[0].token_ids == outs[1].token_ids
    assert [lp for lp in outs[0].logprobs] == [lp for lp in outs[1].logprobs]  # bit for bit


def test_a_model_with_no_width_32_divides_reports_float32(tmp_path):
    """The `odd` preset's layers (200 and 520 features, a 4100-token vocabulary) have no width 32
    divides: under "high" none is split, and the stats say float32, not bf16x3."""
    from workers.model_builder import make_model

    path = make_model("llama", "odd", tmp_path / "llama-odd", seed=0)
    with LLM(model=str(path), cpu_matmul_precision="high", num_kv_blocks=64, max_model_len=512) as llm:
        assert llm.stats()["cpu_matmul"] == "float32"


def test_a_wrong_precision_is_refused(model_dirs):
    with pytest.raises(ValueError, match="cpu_matmul_precision must be one of highest, high, got 'medium'"):
        LLM(model=model_dirs["llama"], cpu_matmul_precision="medium")
    with pytest.raises(ValidationError, match="cpu_matmul_precision"):
        AppArgs(model=model_dirs["llama"], cpu_matmul_precision="medium")
    assert AppArgs(model=model_dirs["llama"], engine_kwargs={"cpu_matmul_precision": "high"}).cpu_matmul_precision == "high"
