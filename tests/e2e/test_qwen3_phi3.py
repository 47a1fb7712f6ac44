"""Qwen3 and Phi-3 served end to end, greedy tokens judged by Hugging Face transformers (teacher
forcing) on the `tiny` presets: on the compiled CPU kernels (decoder stack included) and plain torch,
with prefix caching, chunked prefill, preemption and shared-prefix attention all in play, and on the
Triton kernels (interpreter); Phi-3's LongRoPE with prompts wholly below and wholly above its original
length (256), the two kinds kept apart in the prefix cache, and a prompt that decoding carries across
it (judged against transformers decoding with a KV cache it keeps, which is what the engine computes,
as vLLM does; transformers' generate() instead recomputes the whole sequence with the long factors at
the crossing);
Qwen3 in deterministic mode; an unsupported rope type refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from tests.e2e.families import FAMILIES, GREEDY, check, generate
from tests.e2e.prompts import corpus_ids
from tests.e2e.prompts import test_prompts as make_prompts
from tests.e2e.test_deterministic import run_with_others, target_prompt

ORIGINAL = 256  # the phi3 tiny preset's original_max_position_embeddings


def test_the_presets_have_what_is_tested(family_dirs):
    qwen3 = json.loads(open(f"{family_dirs['qwen3']}/config.json").read())
    phi3 = json.loads(open(f"{family_dirs['phi3']}/config.json").read())
    assert qwen3["head_dim"] == 32 != qwen3["hidden_size"] // qwen3["num_attention_heads"]
    assert phi3["rope_parameters"]["rope_type"] == "longrope" and phi3["rope_parameters"]["partial_rotary_factor"] == 0.75
    assert phi3["original_max_position_embeddings"] == ORIGINAL and phi3["max_position_embeddings"] == 2048
    lengths = [len(p) for p in make_prompts(family_dirs["phi3"])]  # wholly below and wholly above 256
    assert lengths == [1, 7, 33, 320, 341, 500, 129]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_matches_hf(arch, backend, family_dirs, family_oracle, stress_runs):
    prompts, run = make_prompts(family_dirs[arch]), stress_runs(arch, backend)
    check(family_oracle(arch), prompts, run["tokens"])
    assert run["warm_tokens"] == run["tokens"][3:6]
    assert run["stack"] == (backend == "cpu")  # the compiled decoder stack runs both families
    assert (run["cascade_steps"] > 0) == (backend == "cpu")  # the shared 300-token prefix attended once
    stats, warm = run["stats"], run["warm_stats"]
    assert stats["num_preemptions"] > 0 and stats["num_blocks_in_use"] == warm["num_blocks_in_use"] == 0
    # the two prompts sharing 300 tokens are both past 256 for phi3: long alike, they share blocks
    assert stats["prefix_cache_hits"] >= 288 and warm["prefix_cache_hits"] > stats["prefix_cache_hits"]


def test_phi3_long_and_short_prompts_do_not_share_blocks(family_dirs, family_oracle):
    """A prompt of 200 tokens (short factors) and one of 300 starting with the same 200 (long factors
    everywhere): the same tokens, different KV. Each runs alone, one after the other, so the first's
    blocks are in the prefix cache when the second is scheduled: no hit between them, in either order
    (the order reversed after a reset). Controls: a second short prompt (210 tokens) and a second long
    one (280) with that prefix each hit the blocks of their own kind (12 full blocks of 16)."""
    ids = list(corpus_ids(f"{family_dirs['phi3']}/tokenizer.json"))
    short_a, short_b = ids[:200], ids[:200] + ids[9000:9010]
    long_a, long_b = ids[:200] + ids[4000:4100], ids[:200] + ids[7000:7080]
    outs = {}
    with LLM(model=family_dirs["phi3"], attention_backend="cpu") as llm:
        for order in ((short_a, long_a, short_b, long_b), (long_a, short_a, long_b, short_b)):
            cached = []
            for prompt in order:
                out = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
                cached.append(out.num_cached_tokens)
                outs.setdefault(tuple(prompt), out.outputs[0].token_ids)
            assert cached == [0, 0, 192, 192], [len(p) for p in order]
            assert llm.reset_prefix_cache()
    prompts = [short_a, short_b, long_a, long_b]
    check(family_oracle("phi3"), prompts, [outs[tuple(p)] for p in prompts])


def hf_cached_decode_logits(oracle, prompt, outputs):
    """transformers decoding with its KV cache: the prompt in one forward, then each output token alone
    (teacher forcing): the logits that chose each output."""
    model = oracle.model
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        rows = [out.logits[0, -1]]
        for token in outputs[:-1]:
            out = model(torch.tensor([[token]]), cache=out.past_key_values, use_cache=True)
            rows.append(out.logits[0, -1])
    return torch.stack(rows).float()


def test_phi3_decoding_across_the_original_length(family_dirs, family_oracle):
    """A 250-token prompt (short factors) decoded to 262: the tokens at positions 256 and on are rotated
    with the long factors, the cached keys keep their short rotation (vLLM's behaviour). That is what
    transformers' model computes when fed one token at a time with the KV cache kept (not generate(),
    which drops the cache at the crossing and recomputes everything with the long factors, as one forward
    over the whole sequence does): the engine's tokens are its greedy choices there and its logprobs its
    log-softmax (up to position 255 that is one forward over the first 256 tokens; one forward over all
    262, long factors everywhere, differs)."""
    ids = list(corpus_ids(f"{family_dirs['phi3']}/tokenizer.json"))
    prompt, oracle = ids[1000:1250], family_oracle("phi3")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    for backend in ("cpu", "torch"):
        with LLM(model=family_dirs["phi3"], attention_backend=backend, enable_prefix_caching=False) as llm:
            sample = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
        out = sample.token_ids
        cached = torch.log_softmax(hf_cached_decode_logits(oracle, prompt, out), dim=-1)
        below = oracle.log_softmax(prompt + out[:6])[len(prompt) - 1:]  # 256 tokens: short factors throughout
        whole = oracle.log_softmax(prompt + out)[len(prompt) - 1:-1]  # 262 tokens: long factors throughout
        for i, (token, logprobs) in enumerate(zip(out, sample.logprobs, strict=True)):
            assert float(cached[i, token]) >= float(cached[i].max()) - 1e-3, f"{backend}: token {i}"
            assert abs(logprobs[token] - float(cached[i, token])) < 1e-4, f"{backend}: token {i}"
        assert (cached[:7] - below).abs().max() < 1e-4  # positions 249-255: the same as one forward under 256
        assert (cached[7:] - whole[7:]).abs().max() > 1e-2  # from 256 on: not what one forward over all computes


@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_matches_hf_on_the_triton_path(arch, family_dirs, family_oracle):
    """Triton kernels under the interpreter: chunked prefill over blocks of 5 and a prefix-cache hit
    (phi3's long rows through the Triton rotary: tests/workers/test_qwen3_phi3_models.py)."""
    prompts = make_prompts(family_dirs[arch])
    shared = prompts[3][:23]
    chosen = [prompts[1], shared + prompts[2][:9], shared + prompts[0] + prompts[1][:4]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(model=family_dirs[arch], attention_backend="triton", block_size=5, num_kv_blocks=48, max_model_len=96,
             max_num_batched_tokens=16, enable_prefix_caching=True) as llm:
        runner = llm.core.executor.worker.runner
        assert runner.model.model.norm.ops is runner.attention_backend.fused_ops
        first = llm.generate([{"prompt_token_ids": p} for p in chosen[:2]], params)
        second = llm.generate([{"prompt_token_ids": chosen[2]}], params)
    assert second[0].num_cached_tokens == 20
    for prompt, out in zip(chosen, first + second, strict=True):
        assert len(out.outputs[0].token_ids) == 6
        family_oracle(arch).assert_greedy(prompt, out.outputs[0].token_ids)


def test_qwen3_deterministic(family_dirs):
    """Same bits (tokens and logprobs) alone, warm among others under a 16-token budget, and cold among
    others in a pool that preempts (the decoder stack with its q/k norms in fixed-order mode)."""
    model, prompt = family_dirs["qwen3"], target_prompt()
    others = dict(max_other_len=120, max_other_tokens=12)
    with LLM(model=model, attention_backend="cpu", deterministic=True, max_num_batched_tokens=16) as llm:
        alone, _ = run_with_others(llm, prompt, 0, 0)
        assert llm.core.executor.worker.runner.model.model.stack is not None
        warm, out = run_with_others(llm, prompt, 4, seed=2, **others)
        assert out.num_cached_tokens >= 128 and warm == alone
    with LLM(model=model, attention_backend="cpu", deterministic=True, block_size=16, num_kv_blocks=17,
             max_model_len=256, max_num_batched_tokens=32, max_num_seqs=16) as llm:
        cold, out = run_with_others(llm, prompt, 8, seed=4, **others)
        assert out.num_cached_tokens == 0 and cold == alone
        assert llm.stats()["num_preemptions"] > 0


def test_unsupported_rope_type_is_a_value_error(family_dirs, tmp_path):
    model = tmp_path / "phi3-dynamic"
    shutil.copytree(family_dirs["phi3"], model)
    config = json.loads((model / "config.json").read_text())
    config["rope_parameters"]["rope_type"] = "dynamic"
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported"):
        LLM(model=str(model), attention_backend="torch")
