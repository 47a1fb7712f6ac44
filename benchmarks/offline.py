"""kvserve's offline engine on a workload, and the engine's own step overhead."""

from __future__ import annotations

import time

from benchmarks.workloads import Workload, distinct
from engine import LLM, SamplingParams


def _greedy(output_len: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def run_kvserve(model_dir: str, workload: Workload, *, enable_prefix_caching: bool, **engine_kwargs) -> dict:
    """All prompts submitted at once to a fresh engine (cold prefix cache, warm kernels)."""
    with LLM(model=model_dir, enable_prefix_caching=enable_prefix_caching, **engine_kwargs) as llm:
        llm.generate({"prompt_token_ids": [1, 2, 3]}, _greedy(2))  # warm-up, unrelated to the workload
        llm.reset_prefix_cache()
        before = llm.stats()
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], _greedy(workload.output_len))
        elapsed = time.perf_counter() - start
        after = llm.stats()
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    steps = after["num_steps"] - before["num_steps"]
    step_time = after["step_time_s"] - before["step_time_s"]
    forward_time = after["forward_time_s"] - before["forward_time_s"]
    return {
        "name": f"kvserve-{'cache' if enable_prefix_caching else 'nocache'}",
        "output_tokens": generated,
        "elapsed_s": elapsed,
        "output_tokens_per_s": generated / elapsed,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "num_preemptions": after["num_preemptions"] - before["num_preemptions"],
        "num_steps": steps,
        "step_overhead_fraction": 1.0 - forward_time / step_time if step_time else 0.0,
        "token_ids": [o.outputs[0].token_ids for o in outputs],
    }


def measure_step_overhead(model_dir: str, num_seqs: int = 64, prompt_len: int = 64, decode_steps: int = 16,
                          **engine_kwargs) -> dict:
    """Time decode steps with ``num_seqs`` sequences running: the share of step wall time spent
    outside the model forward (scheduling, input preparation, sampling, detokenization)."""
    workload = distinct(model_dir, num_seqs, prompt_len, decode_steps + 8)
    with LLM(model=model_dir, max_num_seqs=num_seqs, **engine_kwargs) as llm:
        core = llm.core
        for i, prompt in enumerate(workload.prompts):
            core.add_request(f"overhead-{i}", prompt, _greedy(workload.output_len))
        running = core.scheduler.running
        while not (len(running) == num_seqs and all(r.num_output_tokens for r in core.scheduler.running)):
            core.step()
            running = core.scheduler.running
        timings = core.timings
        step0, fwd0, n0 = timings.step_time_s, timings.forward_time_s, timings.num_steps
        for _ in range(decode_steps):
            core.step()
        steps = timings.num_steps - n0
        step_time, forward_time = timings.step_time_s - step0, timings.forward_time_s - fwd0
        for i in range(num_seqs):
            core.abort_request(f"overhead-{i}")
    return {
        "num_running": num_seqs,
        "decode_steps": steps,
        "step_ms": 1000 * step_time / steps,
        "forward_ms": 1000 * forward_time / steps,
        "overhead_fraction": 1.0 - forward_time / step_time,
    }
