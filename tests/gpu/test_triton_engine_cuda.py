"""The engine on the compiled Triton path on CUDA: deterministic mode, CUDA graphs against eager
steps, and the start-up warm-up (``kernels.triton.warmup``) leaving nothing to compile while serving.
Run with `make test-gpu` (benchmarks/gpu_check.sh runs these after the kernel tests)."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda():
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"


def test_the_warm_up_leaves_nothing_to_compile_while_serving(model_dirs):
    """After start (the warm-up compiled every variant the configuration can launch), a run of decodes,
    chunked prefills after cached prefixes and split launches, through the CUDA-graph buckets and
    eagerly, compiles no kernel: every Triton kernel's cache for the device is as the start left it."""
    from engine import LLM, SamplingParams
    from kernels.triton import linear, ops
    from tests.e2e.prompts import test_prompts as make_prompts

    kernels = [ops._paged_attention_kernel, ops._merge_splits_kernel, ops._store_kv_kernel, ops._rms_norm_kernel,
               ops._silu_and_mul_kernel, ops._rotary_neox_kernel, linear._linear_kernel]
    prompts = make_prompts(model_dirs["llama"])
    for deterministic, eager in ((False, False), (True, True)):
        with LLM(model=model_dirs["llama"], attention_backend="triton", device="cuda", dtype="bfloat16",
                 block_size=16, num_kv_blocks=512, max_model_len=1024, max_num_batched_tokens=64, max_num_seqs=8,
                 enforce_eager=eager, deterministic=deterministic) as llm:
            device = torch.cuda.current_device()
            before = {k.fn.__name__: set(k.device_caches[device][0]) for k in kernels}
            assert sum(map(len, before.values())) > 5
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
            after = {k.fn.__name__: set(k.device_caches[device][0]) for k in kernels}
        assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
        assert after == before, {name: len(after[name] - before[name]) for name in after}


def test_deterministic_engine_on_cuda(model_dirs):
    """The engine under deterministic=True on the compiled Triton path: a prompt alone and among
    others in 16-token chunks, cold and warm, the same tokens and logprob bits."""
    from engine import LLM
    from tests.e2e.test_deterministic import random_prompt
    from tests.kernels.triton.test_triton_deterministic import run_with_others

    target = random_prompt(random.Random(7), 24)
    kwargs = dict(attention_backend="triton", deterministic=True, device="cuda", block_size=8, num_kv_blocks=128,
                  max_model_len=128)
    with LLM(model=model_dirs["llama"], enable_prefix_caching=False, max_num_batched_tokens=2048, **kwargs) as llm:
        alone = run_with_others(llm, target, 0, 0)[0]
    with LLM(model=model_dirs["llama"], max_num_batched_tokens=16, **kwargs) as llm:
        assert run_with_others(llm, target, 3, seed=1)[0] == alone
        assert run_with_others(llm, target, 8, seed=2)[0] == alone


def test_cuda_graphs_replay_decode_steps_with_the_eager_tokens(model_dirs, hf_oracle):
    """enforce_eager=False on the compiled Triton path: every bucket captured at start, decode-only
    steps replayed (padded buckets included), the eager engine's greedy tokens and HF's."""
    from engine import LLM, SamplingParams
    from tests.e2e.prompts import test_prompts as make_prompts

    prompts = [p[:20 + 7 * i] for i, p in enumerate(make_prompts(model_dirs["llama"])[:5])]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (12, 10, 9, 6, 3)]
    kwargs = dict(attention_backend="triton", device="cuda", dtype="float32", block_size=16, num_kv_blocks=256,
                  max_model_len=512, max_num_seqs=8)
    runs = {}
    for eager in (True, False):
        with LLM(model=model_dirs["llama"], enforce_eager=eager, **kwargs) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            runner = llm.core.executor.worker.runner
            if not eager:
                assert llm.stats()["cuda_graph_sizes"] == [1, 2, 4, 8]
                assert sorted(runner.graphs.graphs) == [1, 2, 4, 8]  # captured, not run eagerly
                assert runner.graphs.num_replays >= 8  # five decoding down to one: buckets 8, 4, 2 and 1
            runs[eager] = outs
    for prompt, e, g in zip(prompts, runs[True], runs[False]):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        hf_oracle("llama").assert_greedy(prompt, g.outputs[0].token_ids)
        for le, lg in zip(e.outputs[0].logprobs, g.outputs[0].logprobs):
            assert le.keys() == lg.keys() and all(abs(le[t] - lg[t]) < 1e-3 for t in le)
