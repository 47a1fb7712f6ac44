"""The `kvserve` command: build checkpoints, generate offline, benchmark, break the Serve app on purpose."""

from __future__ import annotations

import argparse
import sys
import time


def _add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory or Hugging Face repo id (default: the llama `small` preset, built if missing)")
    parser.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)


def _run_generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    prompts = args.prompt or ["The quick brown fox"]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    with LLM(model=args.model, tensor_parallel_size=args.tensor_parallel_size,
             pipeline_parallel_size=args.pipeline_parallel_size) as llm:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        for out in outputs:
            print(f"--- {out.prompt!r}\n{out.prompt}{out.outputs[0].text}  [{out.outputs[0].finish_reason}]")
        stats = llm.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\n{tokens} tokens in {elapsed:.2f}s ({tokens / elapsed:.1f} tok/s); model {llm.config.model.path}; "
          f"prefix-cache hit rate {stats['prefix_cache_hit_rate']:.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from benchmarks.chaos import add_chaos_arguments, run_chaos_command
    from benchmarks.cli import add_bench_arguments, run_bench
    from benchmarks.fuzz import add_fuzz_arguments, run_fuzz
    from benchmarks.gpu_bench import add_bench_gpu_arguments, run_bench_gpu
    from benchmarks.host_tier import add_bench_host_tier_arguments, run_bench_host_tier
    from benchmarks.hybrid_kv import add_bench_hybrid_kv_arguments, run_bench_hybrid_kv
    from benchmarks.kv_quant import add_bench_kv_quant_arguments, run_bench_kv_quant
    from benchmarks.online_vllm import add_bench_online_vllm_arguments, run_bench_online_vllm
    from benchmarks.profile_step import add_profile_step_arguments, run_profile_step
    from benchmarks.serve_bench import add_bench_serve_arguments, run_bench_serve
    from benchmarks.soak import add_soak_arguments, run_soak_command
    from benchmarks.structured import add_bench_structured_arguments, run_bench_structured
    from benchmarks.parallel import add_bench_parallel_arguments, run_bench_parallel
    from benchmarks.pp_transport import add_bench_pp_transport_arguments, run_bench_pp_transport
    from workers.model_builder import add_make_model_arguments, run_make_model

    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve: LLM inference on Ray")
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("make-model", help="build a random Hugging Face checkpoint with its tokenizer")
    add_make_model_arguments(make)
    make.set_defaults(run=run_make_model)
    generate = commands.add_parser("generate", help="generate text with the offline engine")
    _add_generate_arguments(generate)
    generate.set_defaults(run=_run_generate)
    benchmarks = (  # (name, help, add its arguments, run it)
        ("bench", "HF, kvserve and vLLM, each in a fresh process, on the same workloads; the Serve app online",
         add_bench_arguments, run_bench),
        ("bench-online-vllm", "kvserve's Serve app and vLLM's OpenAI server under vLLM's own serving benchmark "
         "client", add_bench_online_vllm_arguments, run_bench_online_vllm),
        ("bench-gpu", "one device, a 1B-shape checkpoint: decode steps beside the bandwidth bound, prefill, the "
         "shared-prompt workload, HF generate, torch vs Triton attention", add_bench_gpu_arguments, run_bench_gpu),
        ("bench-parallel", "TP=1 x PP=1 in-process against tensor- and pipeline-parallel sizes on Ray worker actors: "
         "throughput, dispatch, each stage's compute and wait", add_bench_parallel_arguments, run_bench_parallel),
        ("bench-pp-transport", "a pipeline stage's activations to the next by gloo send/recv (the engine's way) "
         "and by a Ray Compiled Graph channel: step time and each stage's CPU per step",
         add_bench_pp_transport_arguments, run_bench_pp_transport),
        ("bench-host-tier", "multi-turn conversations through a pool holding a quarter of their KV: prefix hit "
         "rate and output tok/s with the host KV tier off, on, and with an unlimited pool",
         add_bench_host_tier_arguments, run_bench_host_tier),
        ("bench-hybrid-kv", "a Gemma-3-shaped model with its sliding-window layers' blocks released vs kept: KV "
         "bytes held per long sequence and the most concurrent long sequences a fixed pool holds",
         add_bench_hybrid_kv_arguments, run_bench_hybrid_kv),
        ("bench-kv-quant", "quantized KV pools (kv_cache_dtype) beside auto: teacher-forced logprob error and "
         "greedy agreement, blocks in equal bytes, and a multi-turn workload through a pool of equal bytes",
         add_bench_kv_quant_arguments, run_bench_kv_quant),
        ("bench-serve", "the Serve app over HTTP against the offline engine", add_bench_serve_arguments,
         run_bench_serve),
        ("bench-structured", "constrained decoding: output tok/s with a 10-field JSON schema against the same "
         "requests unconstrained, and the time to compile a new schema", add_bench_structured_arguments,
         run_bench_structured),
        ("profile-step", "where the time of a decode step goes, N sequences running", add_profile_step_arguments,
         run_profile_step),
        ("chaos", "the Serve app under load while its scheduler actor, a rank and its replica are killed: requests "
         "lost and seconds to serve again", add_chaos_arguments, run_chaos_command),
        ("soak", "the Serve app under a steady load for N minutes: RSS growth of every process, errors, KV blocks "
         "in use at the end", add_soak_arguments, run_soak_command),
        ("fuzz", "malformed OpenAI requests beside good ones against the in-process app: shares answered 4xx, 5xx, "
         "hung, and good requests failed", add_fuzz_arguments, run_fuzz),
    )
    for name, help_text, add_arguments, run in benchmarks:
        command = commands.add_parser(name, help=help_text)
        add_arguments(command)
        command.set_defaults(run=run)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
