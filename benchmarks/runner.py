"""One benchmark system in a fresh process: `python -m benchmarks.runner SPEC.json RESULT.json`.

`kvserve bench` starts one of these per system and workload (benchmarks/fresh.py writes the spec and
reads the result; the protocol is described there). The system is constructed, then the spec's
workload instances run one after the other, the first of them right after construction with no
warm-up request before it. Systems: kvserve-cache, kvserve-nocache, hf-static, hf-continuous, and
kvserve-overhead (the engine's step-overhead probe, no workload). vLLM has its own runner
(benchmarks/vllm_runner.py) for its own interpreter.
"""

from __future__ import annotations

import json
import os
import sys
import time

PROGRESS = "@@bench-progress"  # stdout line prefix: "<PROGRESS> <requests finished>"


def progress(count: int) -> None:
    print(f"{PROGRESS} {count}", flush=True)


def _instances(spec: dict):
    from benchmarks.workloads import Workload

    return [(item["label"], Workload.from_dict(item["workload"])) for item in spec["instances"]]


def _kvserve(spec: dict, instances) -> tuple[float, list[dict], dict]:
    from benchmarks.offline import kvserve_engine, run_instance

    engine = dict(spec["engine"])
    caching = engine.pop("enable_prefix_caching")
    start = time.perf_counter()
    llm = kvserve_engine(spec["model"], enable_prefix_caching=caching, **engine)
    start_s = time.perf_counter() - start
    results = []
    with llm:
        for k, (label, workload) in enumerate(instances):
            records, elapsed, extra = run_instance(llm, workload, progress, request_prefix=f"{k}-")
            results.append({"label": label, "elapsed_s": elapsed, "records": [r.to_dict() for r in records],
                            "extra": extra})
        info = {"kv_blocks": llm.stats()["num_kv_blocks"]}
    return start_s, results, info


def _hf(spec: dict, instances) -> tuple[float, list[dict], dict]:
    from benchmarks.hf_peer import HFContinuous, HFStatic

    start = time.perf_counter()
    if spec["system"] == "hf-static":
        peer = HFStatic(spec["model"], spec["options"].get("hf_batch_size", 8))
    else:
        peer = HFContinuous(spec["model"], [w for _, w in instances], **spec["options"].get("hf_cb", {}))
    start_s = time.perf_counter() - start
    results = []
    try:
        for label, workload in instances:
            records, elapsed, extra = peer.run(workload, progress)
            results.append({"label": label, "elapsed_s": elapsed, "records": [r.to_dict() for r in records],
                            "extra": extra})
    finally:
        if hasattr(peer, "close"):
            peer.close()
    return start_s, results, {}


def _overhead(spec: dict, instances) -> tuple[float, list[dict], dict]:
    from benchmarks.offline import measure_step_overhead

    engine = {k: v for k, v in spec["engine"].items() if k in ("block_size", "kv_cache_memory_bytes", "kv_cache_dtype")}
    start = time.perf_counter()
    overhead = measure_step_overhead(spec["model"], num_seqs=spec["options"]["num_seqs"], **engine)
    return time.perf_counter() - start, [], {"overhead": overhead}


SYSTEMS = {"kvserve-cache": _kvserve, "kvserve-nocache": _kvserve, "kvserve-deterministic": _kvserve, "hf-static": _hf, "hf-continuous": _hf,
           "kvserve-overhead": _overhead}


def main(argv: list[str]) -> int:
    spec_path, result_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    import torch

    torch.set_num_threads(spec["threads"])
    instances = _instances(spec)
    start_s, results, info = SYSTEMS[spec["system"]](spec, instances)
    result = {"system": spec["system"], "pid": os.getpid(), "start_s": start_s, "instances": results,
              "info": info, "torch_threads": torch.get_num_threads(),
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
              "versions": {"torch": torch.__version__, "python": sys.version.split()[0]}}
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
