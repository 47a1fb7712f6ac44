"""`kvserve bench-structured`: what constrained decoding costs.

The workload: 64 requests (independent corpus prompts, nothing shared beyond BOS) that each ask for
an object of one JSON schema with 10 fields, sampled (temperature 1, a seed per request). Figures:

- output tokens/s of the constrained requests against the same requests unconstrained, run with
  each request's output length fixed to what its constrained run produced (``ignore_eos``), so
  both runs make the same tokens in the same batches and differ by the constraint alone; the runs
  alternate, ``--rounds`` times, and every round is reported;
- the time to compile a new schema (a field renamed each time, so none is a cache hit), the first
  one with the grammar backend's start-up (the tokenizer's vocabulary read once per engine);
- with ``--unconstrained-only``, unconstrained throughput alone (fixed ``--output-len``), using only
  the engine's public API, so that the same file runs against an older checkout (``PYTHONPATH``) to
  compare the engine before and after constrained decoding existed.

One process, the engine in it; ``--threads`` torch threads.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "email": {"type": "string", "format": "email"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "created": {"type": "string", "format": "date"},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 16},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["id", "name", "email", "age", "score", "active", "role", "tags", "created", "address"],
}


def add_bench_structured_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory (default: the llama `small` preset, built if missing)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128, help="constrained requests' max_tokens")
    parser.add_argument("--rounds", type=int, default=3, help="constrained / unconstrained pairs, alternating")
    parser.add_argument("--compiles", type=int, default=10, help="new schemas compiled for the compile time")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--unconstrained-only", action="store_true", help="only unconstrained throughput "
                        "(--output-len tokens each): the figure to compare against an older checkout")
    parser.add_argument("--output-len", type=int, default=128, help="--unconstrained-only: tokens per request")
    parser.add_argument("--out", help="write the figures here as JSON")


def _prompts(model_dir: str, num_requests: int, prompt_len: int) -> list[dict]:
    from benchmarks.workloads import independent

    return [{"prompt_token_ids": p} for p in independent(model_dir, num_requests, prompt_len, 1).prompts]


def _timed(llm, prompts, params) -> tuple[float, list, dict]:
    """(wall seconds, outputs, the run's step figures: steps, ms per step, of it ms in the forward,
    and CPU seconds of this process)."""
    before, cpu = llm.stats(), time.process_time()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    after = llm.stats()
    steps = after["num_steps"] - before["num_steps"]
    figures = {"steps": steps, "cpu_s": time.process_time() - cpu,
               "step_ms": 1000 * (after["step_time_s"] - before["step_time_s"]) / steps,
               "forward_ms": 1000 * (after["forward_time_s"] - before["forward_time_s"]) / steps}
    figures["outside_forward_ms"] = figures["step_ms"] - figures["forward_ms"]
    return elapsed, outputs, figures


def _tokens(outputs) -> int:
    return sum(len(o.outputs[0].token_ids) for o in outputs)


def _unconstrained_only(llm, prompts, args) -> dict:
    from engine import SamplingParams

    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.output_len, ignore_eos=True)
              for i in range(len(prompts))]
    llm.generate(prompts[:2], params[:2])  # warm-up
    rounds = []
    for _ in range(args.rounds):
        elapsed, outputs, figures = _timed(llm, prompts, params)
        rounds.append({"elapsed_s": elapsed, "output_tokens": _tokens(outputs),
                       "output_tokens_per_s": _tokens(outputs) / elapsed, **figures})
    return {"rounds": rounds, "best_output_tokens_per_s": max(r["output_tokens_per_s"] for r in rounds),
            "median_output_tokens_per_s": statistics.median(r["output_tokens_per_s"] for r in rounds)}


def _compile_times(llm, count: int) -> dict:
    from engine.sampling_params import StructuredOutputsParams

    manager = llm.core.structured_outputs
    times = []
    for i in range(count + 1):
        schema = copy.deepcopy(SCHEMA)
        schema["properties"][f"name_{i}"] = schema["properties"].pop("name")
        schema["required"] = [f"name_{i}" if r == "name" else r for r in schema["required"]]
        start = time.perf_counter()
        manager.compile(StructuredOutputsParams(json=schema))
        times.append(time.perf_counter() - start)
    return {"first_with_backend_start_s": times[0], "median_s": statistics.median(times[1:]),
            "max_s": max(times[1:]), "count": count}


def _constrained_vs_unconstrained(llm, prompts, args) -> dict:
    import jsonschema

    from engine import SamplingParams
    from engine.sampling_params import StructuredOutputsParams

    so = StructuredOutputsParams(json=SCHEMA)
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, structured_outputs=so)
                   for i in range(len(prompts))]
    llm.generate(prompts[:2], constrained[:2])  # warm-up, and the schema compiled (then a cache hit)
    rounds = []
    for _ in range(args.rounds):
        c_elapsed, c_out, c_fig = _timed(llm, prompts, constrained)
        lengths = [len(o.outputs[0].token_ids) for o in c_out]
        free = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
        u_elapsed, u_out, u_fig = _timed(llm, prompts, free)
        assert [len(o.outputs[0].token_ids) for o in u_out] == lengths
        stopped = [o.outputs[0] for o in c_out if o.outputs[0].finish_reason == "stop"]
        for sample in stopped:
            jsonschema.validate(json.loads(sample.text), SCHEMA)
        c_rate, u_rate = sum(lengths) / c_elapsed, sum(lengths) / u_elapsed
        # the forward is the same work in both runs (same tokens, same batches): with the forward time
        # both had, the ratio that the engine's time outside the forward alone makes
        forward = (c_fig["forward_ms"] + u_fig["forward_ms"]) / 2
        rounds.append({"output_tokens": sum(lengths), "stopped_and_valid": len(stopped),
                       "constrained_s": c_elapsed, "unconstrained_s": u_elapsed,
                       "constrained_tok_s": c_rate, "unconstrained_tok_s": u_rate, "ratio": c_rate / u_rate,
                       "cpu_ratio": u_fig["cpu_s"] / c_fig["cpu_s"],
                       "same_forward_ratio": (forward + u_fig["outside_forward_ms"])
                       / (forward + c_fig["outside_forward_ms"]),
                       "constrained": c_fig, "unconstrained": u_fig})
    ratios = [r["ratio"] for r in rounds]
    return {"rounds": rounds, "median_ratio": statistics.median(ratios), "best_ratio": max(ratios),
            "median_same_forward_ratio": statistics.median(r["same_forward_ratio"] for r in rounds),
            "median_cpu_ratio": statistics.median(r["cpu_ratio"] for r in rounds)}


def bench_structured(args: argparse.Namespace) -> dict:
    import torch

    from engine import LLM

    torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from workers.model_builder import default_model_dir

        model = str(default_model_dir())
    prompts = _prompts(model, args.num_requests, args.prompt_len)
    max_len = args.prompt_len + max(args.max_tokens, args.output_len)
    result = {"model": model, "num_requests": args.num_requests, "prompt_len": args.prompt_len,
              "threads": args.threads, "argv": sys.argv}
    # prefix caching off: every run prefills its prompts (the runs share them)
    with LLM(model=model, max_model_len=max_len, max_num_seqs=max(64, args.num_requests),
             enable_prefix_caching=False) as llm:
        if args.unconstrained_only:
            result["unconstrained"] = _unconstrained_only(llm, prompts, args)
            return result
        result["compile"] = _compile_times(llm, args.compiles)
        result["throughput"] = _constrained_vs_unconstrained(llm, prompts, args)
    return result


def format_result(result: dict) -> str:
    lines = [f"model {result['model']}, {result['num_requests']} requests, prompt {result['prompt_len']} tokens, "
             f"{result['threads']} threads"]
    if "unconstrained" in result:
        for i, r in enumerate(result["unconstrained"]["rounds"]):
            lines.append(f"round {i}: {r['output_tokens']} tokens in {r['elapsed_s']:.2f} s = "
                         f"{r['output_tokens_per_s']:.1f} tok/s ({r['cpu_s']:.2f} CPU s); per step: forward "
                         f"{r['forward_ms']:.1f} ms, outside it {r['outside_forward_ms']:.2f} ms")
        u = result["unconstrained"]
        lines.append(f"unconstrained: best {u['best_output_tokens_per_s']:.1f} tok/s, "
                     f"median {u['median_output_tokens_per_s']:.1f} tok/s")
        return "\n".join(lines)
    c = result["compile"]
    lines.append(f"compile a new 10-field schema: first {1000 * c['first_with_backend_start_s']:.1f} ms "
                 f"(backend start-up included), then median {1000 * c['median_s']:.2f} ms, "
                 f"max {1000 * c['max_s']:.2f} ms over {c['count']}")
    for i, r in enumerate(result["throughput"]["rounds"]):
        c, u = r["constrained"], r["unconstrained"]
        lines.append(f"round {i}: {r['output_tokens']} tokens ({r['stopped_and_valid']} requests stopped, all "
                     f"valid): constrained {r['constrained_tok_s']:.1f} tok/s, unconstrained "
                     f"{r['unconstrained_tok_s']:.1f} tok/s, ratio {r['ratio']:.3f} (CPU time {r['cpu_ratio']:.3f}); "
                     f"per step: forward {c['forward_ms']:.1f} / {u['forward_ms']:.1f} ms, outside it "
                     f"{c['outside_forward_ms']:.2f} / {u['outside_forward_ms']:.2f} ms "
                     f"(same forward: {r['same_forward_ratio']:.3f})")
    t = result["throughput"]
    lines.append(f"constrained / unconstrained: median {t['median_ratio']:.3f}, best {t['best_ratio']:.3f}; "
                 f"CPU time median {t['median_cpu_ratio']:.3f}; "
                 f"same forward median {t['median_same_forward_ratio']:.3f}")
    return "\n".join(lines)


def run_bench_structured(args: argparse.Namespace) -> int:
    result = bench_structured(args)
    print(format_result(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":  # also run as a file: ``python benchmarks/structured.py`` against another checkout
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_structured_arguments(parser)
    sys.exit(run_bench_structured(parser.parse_args()))
