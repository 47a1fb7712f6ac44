"""kvserve's offline engine on a workload, timed per token, and the engine's own step overhead.

Only the engine's public surface is used: ``LLM``, ``LLM.core`` (add_request / step /
has_unfinished_requests / abort_request), ``SamplingParams`` and ``LLM.stats()``; every figure of a
run is a difference of ``stats()`` taken before and after it (and after every step for the
timeline), so several runs can follow each other on one engine."""

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


def kvserve_engine(model_dir: str, *, enable_prefix_caching: bool, **engine_kwargs) -> LLM:
    return LLM(model=model_dir, enable_prefix_caching=enable_prefix_caching, **engine_kwargs)


def run_instance(llm: LLM, workload: Workload, progress: Callable[[int], None] | None = None,
                 request_prefix: str = "") -> tuple[list[RequestRecord], float, dict]:
    """One pass of ``workload`` through ``llm`` as it stands (no warm-up, no cache reset): every
    request that waits for nothing is submitted at once; a later turn is submitted the moment the
    turn it follows has finished. Tokens are timed when the step that made them returns.
    Returns the records (with token ids), the elapsed seconds and the engine's figures for it."""
    core = llm.core
    before = llm.stats()
    followers: dict[int, list[int]] = {}
    for after, prev in workload.predecessor().items():
        followers.setdefault(prev, []).append(after)
    waits = set(workload.predecessor())
    records: list[RequestRecord | None] = [None] * len(workload.requests)

    def submit(i: int, now: float) -> None:
        request = workload.requests[i]
        records[i] = RequestRecord(len(request.prompt), now, token_ids=[])
        core.add_request(f"{request_prefix}{i}", request.prompt, _greedy(request.output_len, RequestOutputKind.DELTA))

    start = time.perf_counter()
    for i in range(len(workload.requests)):
        if i not in waits:
            submit(i, start)
    timeline = []
    peak_usage, waste_at_peak = 0.0, 0.0
    while core.has_unfinished_requests():
        outputs = core.step()
        now = time.perf_counter()
        for out in outputs:
            i = int(out.request_id[len(request_prefix):])
            new = out.outputs[0].token_ids
            records[i].add_tokens(len(new), now)
            records[i].token_ids.extend(new)
            if out.finished:
                records[i].end = now
                records[i].cached_tokens = out.num_cached_tokens
                if progress:
                    progress(1)
                for j in followers.get(i, ()):
                    submit(j, now)
        stats = llm.stats()
        if stats["kv_cache_usage"] > peak_usage:
            peak_usage, waste_at_peak = stats["kv_cache_usage"], stats["kv_cache_waste"]
        queries = stats["prefix_cache_queries"] - before["prefix_cache_queries"]
        hits = stats["prefix_cache_hits"] - before["prefix_cache_hits"]
        timeline.append({"t": now - start, "num_running": stats["num_requests_running"],
                         "prefix_cache_hit_rate": hits / queries if queries else 0.0,
                         "kv_cache_usage": stats["kv_cache_usage"]})
    elapsed = time.perf_counter() - start
    after = llm.stats()
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    step_time = after["step_time_s"] - before["step_time_s"]
    forward_time = after["forward_time_s"] - before["forward_time_s"]
    extra = {
        "mode": "offline",
        "prefix_cache_queries": queries, "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        # sampled after every step (the engine's own peak in stats() spans the engine's whole life)
        "kv_cache_usage_peak": peak_usage, "kv_waste_at_peak": waste_at_peak,
        "kv_blocks": after["num_kv_blocks"], "block_size": after["block_size"],
        "deterministic": llm.config.deterministic,
        "num_preemptions": after["num_preemptions"] - before["num_preemptions"],
        "num_steps": after["num_steps"] - before["num_steps"],
        "step_overhead_fraction": 1.0 - forward_time / step_time if step_time else 0.0,
        "timeline": timeline[::max(1, -(-len(timeline) // TIMELINE_POINTS))],
    }
    return records, elapsed, extra


def run_kvserve(model_dir: str, workload: Workload, *, enable_prefix_caching: bool,
                progress: Callable[[int], None] | None = None, warm_up: bool = False, **engine_kwargs) -> dict:
    """The workload through a fresh engine, summarised (with ``token_ids``). ``warm_up`` first runs
    one short unrelated request and empties the prefix cache; `kvserve bench` does not (its first
    instance is measured cold, its steady instance after the first)."""
    engine_kwargs.setdefault("max_model_len", workload.max_len)
    with kvserve_engine(model_dir, enable_prefix_caching=enable_prefix_caching, **engine_kwargs) as llm:
        if warm_up:
            llm.generate({"prompt_token_ids": [1, 2, 3]}, _greedy(2))
            llm.reset_prefix_cache()
        records, elapsed, extra = run_instance(llm, workload, progress)
    return summarize(f"kvserve-{'cache' if enable_prefix_caching else 'nocache'}", records, elapsed,
                     token_ids=[r.token_ids for r in records], **extra)


def measure_step_overhead(model_dir: str, num_seqs: int = 64, prompt_len: int = 64, decode_steps: int = 16,
                          **engine_kwargs) -> dict:
    """Time decode steps with ``num_seqs`` sequences running: the share of step wall time spent
    outside the model forward (scheduling, input preparation, sampling, detokenization)."""
    workload = distinct(model_dir, num_seqs, prompt_len, decode_steps + 8)
    with LLM(model=model_dir, max_num_seqs=num_seqs, **engine_kwargs) as llm:
        core = llm.core
        for i, prompt in enumerate(workload.prompts):
            core.add_request(f"overhead-{i}", prompt, _greedy(workload.output_len))
        started: set[str] = set()  # requests past their prefill (they have produced a token)
        while len(started) < num_seqs:
            started.update(out.request_id for out in core.step() if out.outputs[0].token_ids)
        before = llm.stats()
        for _ in range(decode_steps):
            core.step()
        after = llm.stats()
        running = after["num_requests_running"]
        for i in range(num_seqs):
            core.abort_request(f"overhead-{i}")
    steps = after["num_steps"] - before["num_steps"]
    step_time = after["step_time_s"] - before["step_time_s"]
    forward_time = after["forward_time_s"] - before["forward_time_s"]
    return {
        "num_running": running,
        "decode_steps": steps,
        "step_ms": 1000 * step_time / steps,
        "forward_ms": 1000 * forward_time / steps,
        "overhead_fraction": 1.0 - forward_time / step_time,
    }
