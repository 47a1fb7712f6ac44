"""CUDA paths: kernels against the naive reference on the device, the engine on GPU in float32 and
bfloat16 against transformers, and KV sizing from gpu_memory_utilization. Run with `make test-gpu`."""

from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, SamplingParams
from kernels import paged_attention
from kernels.reference import naive_causal_attention
from tests.e2e.prompts import test_prompts as make_prompts
from tests.kernels.test_attention import CASES, _build_step

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda():
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, None), (torch.float16, None)])
def test_paged_attention_on_cuda(dtype, tol):
    """Half precision within twice ``attention_bound`` (a spacing of the output plus the rounding of
    the softmax weights to the dtype; twice: SDPA's fused kernels are not ours to bound exactly), not
    an absolute tolerance that outputs near 4 exceed by their rounding alone."""
    from tests.kernels.triton.common import attention_bound

    specs = CASES["mixed"]
    q, k, v, kp, vp, meta, fk, fv = _build_step(specs, 8, 2, 64, 16, dtype)
    to = lambda t: t.cuda()
    meta.slot_mapping, meta.block_tables = to(meta.slot_mapping), to(meta.block_tables)
    meta.seq_lens, meta.query_start_loc = to(meta.seq_lens), to(meta.query_start_loc)
    out = paged_attention(to(q), to(k), to(v), to(kp), to(vp), meta, 1 / math.sqrt(64)).cpu()
    start = 0
    for (_, ql), kk, vv in zip(specs, fk, fv):
        ref = naive_causal_attention(q[start:start + ql].double(), kk.double(), vv.double(), 1 / math.sqrt(64))
        if tol is not None:
            torch.testing.assert_close(out[start:start + ql].double(), ref, atol=tol, rtol=tol)
        else:
            bound = 2 * attention_bound(q[start:start + ql], kk, vv, 1 / math.sqrt(64), dtype)
            assert ((out[start:start + ql].double() - ref).abs() <= bound).all()
        start += ql


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-3), ("bfloat16", 0.25)])
def test_engine_on_cuda_matches_hf(dtype, tol, model_dirs, hf_oracle):
    prompts = make_prompts(model_dirs["llama"])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(model=model_dirs["llama"], device="cuda", dtype=dtype, gpu_memory_utilization=0.3) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert llm.stats()["device"].startswith("cuda")
    oracle = hf_oracle("llama")
    for prompt, out in zip(prompts, outs):
        oracle.assert_greedy(prompt, out.outputs[0].token_ids[:1 if dtype == "bfloat16" else None], tol=tol)


def test_gpu_memory_utilization_sizes_the_pool(model_dirs):
    total = torch.cuda.mem_get_info()[1]
    with LLM(model=model_dirs["llama"], device="cuda", gpu_memory_utilization=0.2) as llm:
        stats = llm.stats()
    pool = stats["kv_pool_bytes_per_rank"]
    assert 0.1 * total < pool <= 0.2 * total, (pool, total)


def test_a_step_does_not_synchronise_the_device_and_times_its_forward_by_events(model_dirs, monkeypatch):
    with LLM(model=model_dirs["llama"], device="cuda", gpu_memory_utilization=0.2) as llm:
        profile = llm.core.executor.worker.memory_profile
        assert profile["peak"] > 0 and profile["outside_torch"] >= 0 and profile["kv_budget"] > 0
        runner = llm.core.executor.worker.runner
        outputs = []
        execute = runner.execute_model
        runner.execute_model = lambda so: (outputs.append(execute(so)), outputs[-1])[1]

        def no_sync(*args, **kwargs):
            raise AssertionError("a step called torch.cuda.synchronize")

        monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
        out = llm.generate([{"prompt_token_ids": [1, 5, 9, 13]}],
                           SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6
    assert len(outputs) == 6 and all(0 < o.forward_time_s <= o.execute_time_s for o in outputs)
