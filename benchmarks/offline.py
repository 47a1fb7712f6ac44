"""kvserve's offline engine on a workload, timed per token, and the engine's own step overhead."""

from __future__ import annotations

import time
from collections.abc import Callable

from benchmarks.records import RequestRecord, summarize
from benchmarks.workloads import Workload, distinct
from engine import LLM, SamplingParams
from engine.sampling_params import RequestOutputKind

TIMELINE_POINTS = 400  # at most this many timeline samples per run (evenly thinned)


def _greedy(output_len: int, kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, output_kind=kind)


def run_kvserve(model_dir: str, workload: Workload, *, enable_prefix_caching: bool,
                progress: Callable[[int], None] | None = None, **engine_kwargs) -> dict:
    """The workload through a fresh engine (cold prefix cache, warm kernels): every request that
    waits for nothing is submitted at once; a later turn is submitted the moment the turn it follows
    has finished. Tokens are timed when the step that made them returns."""
    engine_kwargs.setdefault("max_model_len", workload.max_len)
    with LLM(model=model_dir, enable_prefix_caching=enable_prefix_caching, **engine_kwargs) as llm:
        core = llm.core
        llm.generate({"prompt_token_ids": [1, 2, 3]}, _greedy(2))  # warm-up, unrelated to the workload
        llm.reset_prefix_cache()
        stats, pool = core.scheduler.stats, core.scheduler.kv.block_pool
        queries0, hits0, preempt0 = stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions
        timings = core.timings
        steps0, step_time0, fwd_time0 = timings.num_steps, timings.step_time_s, timings.forward_time_s
        stats.kv_peak_blocks, stats.kv_waste_at_peak = 0, 0.0

        followers: dict[int, list[int]] = {}
        for after, before in workload.predecessor().items():
            followers.setdefault(before, []).append(after)
        waits = set(workload.predecessor())
        records: list[RequestRecord | None] = [None] * len(workload.requests)
        token_ids: list[list[int]] = [[] for _ in workload.requests]

        def submit(i: int, now: float) -> None:
            request = workload.requests[i]
            records[i] = RequestRecord(len(request.prompt), now)
            core.add_request(str(i), request.prompt,
                             _greedy(request.output_len, RequestOutputKind.DELTA))

        start = time.perf_counter()
        for i in range(len(workload.requests)):
            if i not in waits:
                submit(i, start)
        timeline = []
        while core.has_unfinished_requests():
            outputs = core.step()
            now = time.perf_counter()
            for out in outputs:
                i = int(out.request_id)
                new = out.outputs[0].token_ids
                records[i].add_tokens(len(new), now)
                token_ids[i].extend(new)
                if out.finished:
                    records[i].end = now
                    records[i].cached_tokens = out.num_cached_tokens
                    if progress:
                        progress(1)
                    for j in followers.get(i, ()):
                        submit(j, now)
            queries = stats.prefix_cache_queries - queries0
            timeline.append({"t": now - start, "num_running": len(core.scheduler.running),
                             "prefix_cache_hit_rate": (stats.prefix_cache_hits - hits0) / queries if queries else 0.0,
                             "kv_cache_usage": pool.usage})
        elapsed = time.perf_counter() - start
        queries, hits = stats.prefix_cache_queries - queries0, stats.prefix_cache_hits - hits0
        step_time, fwd_time = timings.step_time_s - step_time0, timings.forward_time_s - fwd_time0
        return summarize(
            f"kvserve-{'cache' if enable_prefix_caching else 'nocache'}", records, elapsed, mode="offline",
            prefix_cache_queries=queries, prefix_cache_hits=hits,
            prefix_cache_hit_rate=hits / queries if queries else 0.0,
            kv_cache_usage_peak=stats.kv_peak_blocks / pool.num_usable_blocks,
            kv_waste_at_peak=stats.kv_waste_at_peak,
            kv_blocks=pool.num_usable_blocks, block_size=core.config.cache.block_size,
            num_preemptions=stats.num_preemptions - preempt0,
            num_steps=timings.num_steps - steps0,
            step_overhead_fraction=1.0 - fwd_time / step_time if step_time else 0.0,
            timeline=timeline[::max(1, -(-len(timeline) // TIMELINE_POINTS))],
            token_ids=token_ids,
        )


def measure_step_overhead(model_dir: str, num_seqs: int = 64, prompt_len: int = 64, decode_steps: int = 16,
                          **engine_kwargs) -> dict:
    """Time decode steps with ``num_seqs`` sequences running: the share of step wall time spent
    outside the model forward (scheduling, input preparation, sampling, detokenization)."""
    workload = distinct(model_dir, num_seqs, prompt_len, decode_steps + 8)
    with LLM(model=model_dir, max_num_seqs=num_seqs, **engine_kwargs) as llm:
        core = llm.core
        for i, prompt in enumerate(workload.prompts):
            core.add_request(f"overhead-{i}", prompt, _greedy(workload.output_len))
        while not (len(core.scheduler.running) == num_seqs
                   and all(r.num_output_tokens for r in core.scheduler.running)):
            core.step()
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
