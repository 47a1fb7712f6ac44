"""Mixture-of-experts models (Mixtral, Qwen3-MoE) against Hugging Face transformers by teacher forcing
at tensor-parallel size 1, on the compiled CPU kernels and on plain torch, with prefix caching, chunked
prefill and preemption in play; deterministic mode on Mixtral; the settings refused."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.conftest import oracles_of
from tests.e2e.prompts import test_prompts as make_prompts
from tests.e2e.test_deterministic import run_with_others, target_prompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
MOE_ARCHS = ("mixtral", "qwen3_moe")
# a pool of 480 tokens for prompts of 823 (563 unshared) and a 64-token budget: prompts are chunked, requests preempted
STRESS = dict(block_size=16, num_kv_blocks=30, max_model_len=400, max_num_batched_tokens=64, max_num_seqs=8)


def stress_prompts(model_dir: str) -> list[list[int]]:
    """33, 320 and 341 tokens (the last two sharing 300) and 129."""
    prompts = make_prompts(model_dir)
    return prompts[2:5] + prompts[6:]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    from workers.model_builder import make_model

    root = tmp_path_factory.mktemp("moe-models")
    return {arch: str(make_model(arch, "tiny", root / f"{arch}-tiny", seed=0)) for arch in MOE_ARCHS}


@pytest.fixture(scope="module")
def moe_oracle(moe_dirs):
    return oracles_of(moe_dirs)


def moe_layers(llm):
    model = llm.core.executor.worker.runner.model
    return [m for m in model.modules() if type(m).__name__ == "FusedMoE"]


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_moe_matches_hf_with_caching_chunking_and_preemption(arch, backend, moe_dirs, moe_oracle):
    prompts = stress_prompts(moe_dirs[arch])
    with LLM(model=moe_dirs[arch], attention_backend=backend, **STRESS) as llm:
        layers = moe_layers(llm)
        assert layers and all((m.cpu_experts is not None) == (backend == "cpu") for m in layers)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        for prompt, out in zip(prompts, outs):
            moe_oracle(arch).assert_greedy(prompt, out.outputs[0].token_ids)
        stats = llm.stats()
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] >= 288  # the shared 300-token prefix
        # warm: what the small pool still caches of the two prompts is hit (the shared prefix at least
        # for the second), and the tokens do not change
        hits = stats["prefix_cache_hits"]
        again = llm.generate([{"prompt_token_ids": p} for p in prompts[1:3]], GREEDY)
        cached = [o.num_cached_tokens for o in again]
        assert cached[1] >= 288 and llm.stats()["prefix_cache_hits"] == hits + sum(cached)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs[1:3]]
        assert llm.stats()["num_blocks_in_use"] == 0


def test_mixtral_deterministic_same_bits_in_any_batch(moe_dirs):
    """deterministic=True: the target's tokens and logprobs alone, cold, at the default budget equal
    those among 8 others at a 32-token budget (chunked), and again with its prefix cached."""
    prompt = target_prompt()
    kwargs = dict(model=moe_dirs["mixtral"], attention_backend="cpu", deterministic=True)
    with LLM(max_num_batched_tokens=2048, enable_prefix_caching=False, **kwargs) as llm:
        alone, _ = run_with_others(llm, prompt, 0, 0)
    with LLM(max_num_batched_tokens=32, **kwargs) as llm:
        assert run_with_others(llm, prompt, 8, seed=5, max_other_len=150, max_other_tokens=16)[0] == alone
        crowded, out = run_with_others(llm, prompt, 3, seed=6, max_other_len=150, max_other_tokens=16)
        assert out.num_cached_tokens >= 128 and crowded == alone


def test_unsupported_settings_are_refused(moe_dirs, model_dirs):
    with pytest.raises(ValueError, match="enable_expert_parallel places experts across tensor-parallel ranks: it "
                                         "needs tensor_parallel_size 2 or more, not 1"):
        LLM(model=moe_dirs["mixtral"], enable_expert_parallel=True)
    with pytest.raises(ValueError, match="enable_expert_parallel needs a mixture-of-experts model; LlamaForCausalLM "
                                         "has no experts"):
        LLM(model=model_dirs["llama"], tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="enable_expert_parallel places whole experts on ranks: 8 experts cannot "
                                         "cover 16 ranks"):
        LLM(model=moe_dirs["mixtral"], tensor_parallel_size=16, enable_expert_parallel=True)


def test_expert_parallel_is_an_app_argument(moe_dirs):
    """The flat key and engine_kwargs (Ray Serve LLM's shape) both reach the engine's settings."""
    from cluster.app_args import ENGINE_KWARGS, AppArgs
    from engine import engine_config

    flat = AppArgs.model_validate({"model": moe_dirs["mixtral"], "tensor_parallel_size": 2,
                                   "enable_expert_parallel": True})
    nested = AppArgs.model_validate({"model": moe_dirs["mixtral"], "tensor_parallel_size": 2,
                                     "engine_kwargs": {"enable_expert_parallel": True}})
    assert flat.enable_expert_parallel and nested.enable_expert_parallel
    config = engine_config(flat.model, **{key: getattr(flat, key) for key in ENGINE_KWARGS})
    assert config.parallel.enable_expert_parallel and config.parallel.tensor_parallel_size == 2
    assert not AppArgs.model_validate({"model": moe_dirs["mixtral"]}).enable_expert_parallel
