"""Qwen3 and Phi-3 for the end-to-end and tensor-parallel tests (tests/e2e/test_qwen3_phi3.py,
tests/cluster/test_qwen3_phi3_tp.py): not in ``ARCHS``, so that every other test does not run them.
The session fixtures over them (``family_dirs``, ``family_oracle``, ``stress_runs``) are in tests/conftest.py."""

from __future__ import annotations

from engine import LLM, SamplingParams
from tests.e2e.prompts import test_prompts as make_prompts

FAMILIES = ("qwen3", "phi3")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# a pool of ~1.3 long sequences and a 64-token budget: chunked prefill and preemption (as test_greedy_vs_hf)
STRESS = dict(block_size=16, num_kv_blocks=48, max_model_len=520, max_num_batched_tokens=64, max_num_seqs=8)


def generate(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def check(oracle, prompts, outputs):
    for prompt, out in zip(prompts, outputs, strict=True):
        assert len(out) == GREEDY.max_tokens
        oracle.assert_greedy(prompt, out)


def stress_run(model_dir: str, backend: str) -> dict:
    """The standard prompts' greedy tokens and the engine's stats under ``STRESS``, then the tokens and
    stats of a warm rerun of prompts 3-5, whether the decoder stack ran and how many steps attended
    shared-prefix groups."""
    prompts = make_prompts(model_dir)
    with LLM(model=model_dir, attention_backend=backend, **STRESS) as llm:
        run = {"tokens": generate(llm, prompts), "stats": llm.stats()}
        run["warm_tokens"], run["warm_stats"] = generate(llm, prompts[3:6]), llm.stats()
        run["stack"] = llm.core.executor.worker.runner.model.model.stack is not None
        run["cascade_steps"] = llm.core.executor.worker.runner.batch.num_cascade_steps
    return run
