"""`kvserve bench-gpu` (also `python -m benchmarks.gpu_bench`: it needs no Ray): the engine on one device
with a 1B-shape Llama checkpoint built locally (random weights, bf16).

Reported, as JSON and a short table:
- the device's copy bandwidth (a large device-to-device copy, bytes read + written per second);
- decode step time at batch 1, 8, 64 and 256 beside the memory-bandwidth bound of that step (bytes of
  the weights a decode reads, plus the KV it attends over, divided by the copy bandwidth);
- prefill tokens/s (distinct prompts, nothing cached);
- the shared-system-prompt workload with prefix caching on and off (output tokens/s);
- Hugging Face `generate` on the same device and checkpoint, one static batch, as the peer;
- the torch and Triton attention backends: step times, and greedy tokens compared teacher-forced (the
  Triton engine predicts every next token of the torch engine's outputs, given the tokens before it);
- CUDA graphs on vs off (on CUDA, the Triton backend with ``enforce_eager=False``): decode step times
  at the same batch sizes, and graph replays against eager steps of the same engine: every decode step
  of a greedy run is replayed through its graph and run eagerly on the same inputs (``graph_vs_eager``),
  their logits and argmax tokens compared;
the command exits 1 when the backends agree on fewer than ``--min-agreement`` of the positions, or the
graphs and eager steps on fewer than ``--min-graph-agreement`` (or, where given, differ by more than
``--max-graph-logit-diff``). Those two thresholds are provisional until the first GPU run has measured
them in bfloat16 (the report keeps the measured values): a graph bucket plans its launches for a
``max_model_len`` context (other split counts than the eager step's), so its logits differ by rounding,
and near-ties can change a token.

On a CPU device the Triton backend runs under its interpreter (set here before the kernels load), so a
tiny preset smoke-tests every part of the command (tests/benchmarks/test_gpu_bench.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.graph_agreement import graph_vs_eager, greedy

DEFAULT_BATCHES = (1, 8, 64, 256)


def add_bench_gpu_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint directory or Hugging Face repo id (default: the llama `1b` "
                                        "preset in --dtype, built if missing)")
    parser.add_argument("--preset", default="1b", help="make-model preset when --model is not given")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on CPU by default")
    parser.add_argument("--backends", nargs="+", default=["torch", "triton"], choices=["torch", "triton", "cpu"])
    parser.add_argument("--batches", nargs="+", type=int, default=list(DEFAULT_BATCHES))
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of the decode-step runs")
    parser.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per batch size")
    parser.add_argument("--prefill-prompts", type=int, default=32)
    parser.add_argument("--prefill-len", type=int, default=1024)
    parser.add_argument("--shared-requests", type=int, default=128, help="requests of the shared-prompt workload")
    parser.add_argument("--new-tokens", type=int, default=64, help="output tokens per request (workload, HF)")
    parser.add_argument("--hf-batch", type=int, default=64, help="static batch of Hugging Face generate (0: skip)")
    parser.add_argument("--agreement-prompts", type=int, default=16)
    parser.add_argument("--agreement-len", type=int, default=32, help="greedy tokens compared per prompt")
    parser.add_argument("--min-agreement", type=float, default=0.99)
    parser.add_argument("--min-graph-agreement", type=float, default=0.99,
                        help="least share of decode positions whose argmax token a graph replay and the eager step "
                             "agree on (provisional: to be set from the first GPU run's measurement)")
    parser.add_argument("--max-graph-logit-diff", type=float, default=None,
                        help="largest |logit difference| between a graph replay and the eager step allowed "
                             "(default: reported, not checked, until a GPU run has measured it)")
    parser.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph runs")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="KV pool per engine (default: 16 GiB on CUDA, 512 MiB on CPU)")
    parser.add_argument("--out", default="docs/bench/gpu.json")


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench-gpu: --device cuda, but torch sees no CUDA device")
    return name


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int | None = None, repeats: int = 10) -> float:
    """Bytes per second a large device copy moves (each byte read once and written once)."""
    import torch

    nbytes = nbytes or (1 << 30 if device == "cuda" else 256 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def decode_bytes(hf_config: dict, dtype_bytes: int, batch: int, context: int) -> int:
    """Bytes one decode step must read: every weight but the embedding table's unread rows, and the K/V
    of ``batch`` sequences of ``context`` tokens."""
    hidden, layers = hf_config["hidden_size"], hf_config["num_hidden_layers"]
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads", heads)
    head_dim = hf_config.get("head_dim") or hidden // heads
    inter, vocab = hf_config["intermediate_size"], hf_config["vocab_size"]
    qkv_bias = hf_config.get("model_type") == "qwen2" or hf_config.get("attention_bias", False)
    per_layer = (hidden + qkv_bias) * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden \
        + 3 * hidden * inter + 2 * hidden
    lm_head = vocab * hidden  # read whole; the embedding table only for ``batch`` rows (tied: the same matrix)
    weights = layers * per_layer + lm_head + hidden + batch * hidden
    kv = batch * context * layers * 2 * kv_heads * head_dim
    return (weights + kv) * dtype_bytes


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def decode_step_times(llm, prompts: list[list[int]], steps: int) -> float:
    """Median seconds of a decode step with ``len(prompts)`` sequences running (prefills done first)."""
    core = llm.core
    ids = [f"decode-{len(prompts)}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        core.add_request(request_id, prompt, greedy(steps + 4))
    started: set[str] = set()
    while len(started) < len(prompts):
        started.update(out.request_id for out in core.step() if out.outputs[0].token_ids)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()  # returns once the sampled ids are read back: the device has finished the step
        times.append(time.perf_counter() - start)
    for request_id in ids:
        core.abort_request(request_id)
    while core.has_unfinished_requests():
        core.step()
    return statistics.median(times)


def prefill_rate(llm, prompts: list[list[int]]) -> float:
    """Prompt tokens per second over distinct prompts, one output token each."""
    llm.reset_prefix_cache()
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(1))
    return sum(map(len, prompts)) / (time.perf_counter() - start)


def _engine(model_dir: str, backend: str, args, device: str, dtype: str, **overrides):
    from engine import LLM

    kwargs = dict(device=device, dtype=dtype, attention_backend=backend, max_num_seqs=max(args.batches),
                  max_num_batched_tokens=max(2048, args.prefill_len), kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                  max_model_len=max(args.prefill_len, args.prompt_len + args.decode_steps + 8) + 64)
    kwargs.update(overrides)
    return LLM(model_dir, **kwargs)


def decode_table(llm, args, dtype: str, hf_config: dict, bandwidth: float, corpus: list[int]) -> list[dict]:
    """Decode step time per batch size of ``args.batches``, beside the memory-bandwidth bound."""
    dtype_bytes = 2 if dtype in ("bfloat16", "float16") else 4
    rows = []
    for batch in args.batches:
        span = len(corpus) - args.prompt_len
        prompts = [corpus[(i * 7919) % span:(i * 7919) % span + args.prompt_len] for i in range(batch)]
        step_s = decode_step_times(llm, prompts, args.decode_steps)
        context = args.prompt_len + args.decode_steps // 2
        bound_s = decode_bytes(hf_config, dtype_bytes, batch, context) / bandwidth
        rows.append({"batch": batch, "step_ms": 1000 * step_s, "bound_ms": 1000 * bound_s,
                     "x_bound": step_s / bound_s, "tokens_per_s": batch / step_s})
    return rows


def bench_backend(model_dir: str, backend: str, args, device: str, dtype: str, hf_config: dict,
                  bandwidth: float, corpus: list[int]) -> dict:
    """Decode steps per batch size and prefill rate of one backend."""
    out: dict = {}
    with _engine(model_dir, backend, args, device, dtype) as llm:
        out["decode"] = decode_table(llm, args, dtype, hf_config, bandwidth, corpus)
        span = len(corpus) - args.prefill_len
        prompts = [corpus[(i * 104729) % span:(i * 104729) % span + args.prefill_len]
                   for i in range(args.prefill_prompts)]
        out["prefill_tokens_per_s"] = prefill_rate(llm, prompts)
    _free(device)
    return out


def shared_prompt(model_dir: str, backend: str, args, device: str, dtype: str) -> dict:
    from benchmarks.offline import run_kvserve
    from benchmarks.workloads import shared_system_prompt

    workload = shared_system_prompt(model_dir, num_requests=args.shared_requests, output_len=args.new_tokens)
    result = {}
    for caching in (True, False):
        summary = run_kvserve(model_dir, workload, enable_prefix_caching=caching, device=device, dtype=dtype,
                              attention_backend=backend, max_num_seqs=max(args.batches),
                              kv_cache_memory_bytes=args.kv_cache_memory_bytes)
        result["cache" if caching else "nocache"] = summary["output_tokens_per_s"]
        _free(device)
    return result


def hf_generate(model_dir: str, prompts: list[list[int]], new_tokens: int, device: str, dtype: str) -> float:
    """Output tokens per second of Hugging Face ``generate`` over one static batch (greedy)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding
    with torch.inference_mode():
        model.generate(ids[:1, :8], max_new_tokens=2, do_sample=False)  # load kernels before timing
        _sync(device)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)
        _sync(device)
    elapsed = time.perf_counter() - start
    produced = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    del model
    _free(device)
    return produced / elapsed


def cuda_graphs(model_dir: str, args, device: str, dtype: str, hf_config: dict, bandwidth: float,
                corpus: list[int], eager: dict) -> dict:
    """The Triton backend with ``enforce_eager=False``: decode steps beside the eager ones (``eager``,
    that backend's ``bench_backend`` result), and graph replays against eager steps of the same engine
    (``graph_vs_eager``)."""
    if device != "cuda" or "triton" not in args.backends or args.no_graphs:
        return {"status": "not run: they need CUDA and the triton backend" if not args.no_graphs
                else "not run (--no-graphs)"}
    with _engine(model_dir, "triton", args, device, dtype, enforce_eager=False) as llm:
        sizes = llm.stats()["cuda_graph_sizes"]
        if not sizes:
            _free(device)
            return {"status": "capture failed: every step ran eagerly (the engine's log says why)"}
        rows = decode_table(llm, args, dtype, hf_config, bandwidth, corpus)
        agreement = graph_vs_eager(llm, agreement_prompts(args, corpus), args.agreement_len)
    _free(device)
    for row, before in zip(rows, eager["decode"]):
        row["x_eager"] = before["step_ms"] / row["step_ms"]
    return {"status": "captured", "sizes": sizes, "decode": rows, "agreement": agreement}


def agreement_prompts(args, corpus: list[int]) -> list[list[int]]:
    span = len(corpus) - args.prompt_len
    return [corpus[(i * 3571) % span:(i * 3571) % span + args.prompt_len] for i in range(args.agreement_prompts)]


def backend_agreement(model_dir: str, reference: str, other: str, args, device: str, dtype: str,
                      corpus: list[int]) -> dict:
    """Greedy tokens of ``reference``, and the share of them ``other`` predicts teacher-forced."""
    prompts = agreement_prompts(args, corpus)
    with _engine(model_dir, reference, args, device, dtype) as llm:
        outputs = [o.outputs[0].token_ids for o in
                   llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(args.agreement_len))]
    _free(device)
    forced = [(p + out[:k], out[k]) for p, out in zip(prompts, outputs) for k in range(len(out))]
    with _engine(model_dir, other, args, device, dtype) as llm:
        predicted = [o.outputs[0].token_ids[0] for o in
                     llm.generate([{"prompt_token_ids": ids} for ids, _ in forced], greedy(1))]
    _free(device)
    agree = sum(p == want for p, (_, want) in zip(predicted, forced))
    return {"reference": reference, "other": other, "positions": len(forced), "agreeing": agree,
            "agreement": agree / len(forced)}


def bench_gpu(args) -> dict:
    device = _device(args.device)
    if device == "cpu" and "triton" in args.backends:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, on first use
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    if args.kv_cache_memory_bytes is None:
        args.kv_cache_memory_bytes = 16 << 30 if device == "cuda" else 512 << 20
    import torch

    from benchmarks.workloads import corpus_token_ids
    from engine.config import ModelConfig
    from workers.model_builder import ensure_model
    from workers.model_source import resolve_model

    if args.model is None:
        model_dir = str(ensure_model("llama", args.preset, dtype=dtype))
    else:
        model_dir = str(resolve_model(args.model))
    hf_config = ModelConfig.from_dir(model_dir).hf_config
    corpus = corpus_token_ids(model_dir)
    started = time.perf_counter()
    report: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "dtype": dtype,
                    "model": model_dir, "torch": torch.__version__, "threads": torch.get_num_threads()}
    report["copy_bandwidth_gb_s"] = copy_bandwidth(device) / 1e9
    bandwidth = report["copy_bandwidth_gb_s"] * 1e9
    report["backends"] = {b: bench_backend(model_dir, b, args, device, dtype, hf_config, bandwidth, corpus)
                          for b in args.backends}
    report["shared_system_prompt_output_tokens_per_s"] = shared_prompt(model_dir, args.backends[0], args, device,
                                                                       dtype)
    if args.hf_batch:
        span = len(corpus) - args.prompt_len
        prompts = [corpus[(i * 613) % span:(i * 613) % span + args.prompt_len] for i in range(args.hf_batch)]
        report["hf_generate_output_tokens_per_s"] = hf_generate(model_dir, prompts, args.new_tokens, device, dtype)
    if len(args.backends) > 1:
        report["agreement"] = backend_agreement(model_dir, args.backends[0], args.backends[1], args, device, dtype,
                                                corpus)
    report["cuda_graphs"] = cuda_graphs(model_dir, args, device, dtype, hf_config, bandwidth, corpus,
                                        report["backends"].get("triton", {}))
    report["thresholds"] = {"min_agreement": args.min_agreement, "min_graph_agreement": args.min_graph_agreement,
                            "max_graph_logit_diff": args.max_graph_logit_diff,
                            "graph_thresholds": "provisional: not yet measured on a GPU in bfloat16"}
    report["elapsed_s"] = time.perf_counter() - started
    return report


def format_gpu_report(report: dict) -> str:
    lines = [f"{report['device']} {report['dtype']}: copy bandwidth {report['copy_bandwidth_gb_s']:.0f} GB/s"]
    for backend, result in report["backends"].items():
        lines.append(f"{backend}: prefill {result['prefill_tokens_per_s']:,.0f} tok/s")
        for d in result["decode"]:
            lines.append(f"  batch {d['batch']:>4}: step {d['step_ms']:8.2f} ms, bound {d['bound_ms']:7.2f} ms "
                         f"({d['x_bound']:.2f}x), {d['tokens_per_s']:,.0f} tok/s")
    shared = report["shared_system_prompt_output_tokens_per_s"]
    lines.append(f"shared system prompt: {shared['cache']:,.0f} tok/s cached, {shared['nocache']:,.0f} uncached")
    if "hf_generate_output_tokens_per_s" in report:
        lines.append(f"HF generate (static batch): {report['hf_generate_output_tokens_per_s']:,.0f} tok/s")
    if "agreement" in report:
        a = report["agreement"]
        lines.append(f"{a['other']} vs {a['reference']}: {a['agreeing']}/{a['positions']} greedy positions agree "
                     f"({a['agreement']:.1%})")
    graphs = report["cuda_graphs"]
    lines.append(f"CUDA graphs: {graphs['status']}")
    for d in graphs.get("decode", []):
        lines.append(f"  batch {d['batch']:>4}: step {d['step_ms']:8.2f} ms ({d['x_bound']:.2f}x the bound, "
                     f"{d['x_eager']:.2f}x faster than eager)")
    if "agreement" in graphs:
        a = graphs["agreement"]
        lines.append(f"  graph replays vs eager steps: {a['agreeing']}/{a['positions']} decode positions agree "
                     f"({a['agreement']:.1%}) over {a['steps']} steps, {a['identical_logits']} with identical logits; "
                     f"largest logit difference {a['max_logit_diff']:.3g} (logits up to {a['max_abs_logit']:.3g})")
    lines.append(f"{report['elapsed_s']:.0f} s in all")
    return "\n".join(lines)


def run_bench_gpu(args: argparse.Namespace) -> int:
    report = bench_gpu(args)
    print(format_gpu_report(report))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    failed = 0
    graphs = report["cuda_graphs"].get("agreement")
    for what, agreement, least in (("the backends", report.get("agreement"), args.min_agreement),
                                   ("CUDA graph replays and eager steps", graphs, args.min_graph_agreement)):
        if agreement is not None and agreement["agreement"] < least:
            print(f"bench-gpu: {what} agree on {agreement['agreement']:.1%} of greedy positions, below "
                  f"{least:.0%}", file=sys.stderr)
            failed = 1
    most = getattr(args, "max_graph_logit_diff", None)
    if graphs is not None and most is not None and graphs["max_logit_diff"] > most:
        print(f"bench-gpu: a CUDA graph replay's logits differ from the eager step's by "
              f"{graphs['max_logit_diff']:.3g}, more than {most:.3g}", file=sys.stderr)
        failed = 1
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_bench", description=__doc__.splitlines()[0])
    add_bench_gpu_arguments(parser)
    return run_bench_gpu(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
