"""`kvserve profile-step`: where the time of one decode step goes, with N sequences running.

The engine runs in this process (tensor_parallel_size 1). N requests share a system prompt (or not)
and are stepped until all of them decode; then each phase of the next steps is timed by wrapping the
engine's own methods (scheduling, input preparation, the model forward, logits, sampling, the
scheduler's update, output processing), and a second pass under torch's profiler splits the
forward into operator families: matrix products, attention, the fused layer ops, other torch ops,
and what is left is Python and dispatch between them.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from engine.config import CPU_MATMUL_PRECISIONS, SchedulerConfig
from kernels.kv_quant import KV_CACHE_DTYPES

PHASES = ("schedule", "prepare inputs", "forward", "logits", "sample", "update", "outputs")
OP_FAMILIES = {
    # the compiled experts' op is counted whole (its routing and weighted scatter are a sliver of it)
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "kvserve_cpu::linear",
               "kvserve_cpu::moe_experts"),
    "attention": ("kvserve_cpu::paged_attention", "kvserve_cpu::store_kv"),
    "fused layer ops": ("kvserve_cpu::rms_norm", "kvserve_cpu::fused_add_rms_norm", "kvserve_cpu::silu_and_mul",
                        "kvserve_cpu::rotary_embedding"),
}


# the plain-torch attention's ops: attention under the torch backend only (on the compiled one a softmax
# is a mixture of experts' router, an index_select the embedding's lookup)
TORCH_ATTENTION = ("aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::index_copy_", "aten::index_select",
                   "aten::_softmax", "aten::masked_fill")


def add_profile_step_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory or Hugging Face repo id (default: the llama `small` preset, built if missing)")
    parser.add_argument("--num-seqs", type=int, default=64, help="sequences running in the profiled steps")
    parser.add_argument("--prompt-len", type=int, default=544, help="prompt tokens per sequence")
    parser.add_argument("--shared-prefix", type=int, default=512, help="leading prompt tokens all sequences share")
    parser.add_argument("--steps", type=int, default=20, help="decode steps to time (each pass)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "cpu"))
    parser.add_argument("--no-cascade", action="store_true", help="turn shared-prefix attention off")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="the KV pool's format")
    parser.add_argument("--cpu-matmul-precision", default="highest", choices=CPU_MATMUL_PRECISIONS,
                        help="the compiled CPU linear's products: float32, or bf16x3 on AMX tiles (high)")
    parser.add_argument("--kv-gib", type=float, default=None,
                        help="KV bytes (default: the engine's; 64 sequences of 2k tokens need 4 GiB in float32)")


class _Timers:
    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.wrapped: list[tuple[object, str, object]] = []  # (object, attribute, its own value or None)

    def wrap(self, obj, name: str, phase: str) -> None:
        inner = getattr(obj, name)
        self.wrapped.append((obj, name, vars(obj).get(name)))

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.total[phase] += time.perf_counter() - start

        setattr(obj, name, timed)


@contextmanager
def _instrumented(core):
    """Time the engine's phases by wrapping its methods on the instances (nothing global changes)."""
    runner = core.executor.worker.runner
    timers = _Timers()
    timers.wrap(core.scheduler, "schedule", "schedule")
    timers.wrap(core.scheduler, "update_from_output", "update")
    timers.wrap(core.outputs, "process", "outputs")
    timers.wrap(runner.batch, "update", "prepare inputs")
    timers.wrap(runner.batch, "prepare", "prepare inputs")
    timers.wrap(runner.model, "forward", "forward")
    timers.wrap(runner.model, "compute_logits", "logits")
    if runner.sampler is not None:
        timers.wrap(runner, "sampler", "sample")
    try:
        yield timers
    finally:
        for obj, name, own in timers.wrapped:
            if own is None:
                delattr(obj, name)  # the class's method shows again
            else:
                setattr(obj, name, own)


def _op_family(name: str, backend: str) -> str:
    if name == "kvserve_cpu::decoder_stack":  # its own time: the C++ between the ops it runs
        return "python and dispatch"
    if backend == "torch" and name.startswith(TORCH_ATTENTION):
        return "attention"
    for family, prefixes in OP_FAMILIES.items():
        if name.startswith(prefixes):
            return family
    return "other torch ops"


def _linear_flops(model, rows: int) -> float:
    """FLOPs of a decode step's linear layers, experts and LM head for ``rows`` sequences: 2 x rows x
    the weights' elements each token meets (a packed weight has as many as the matrix; of a mixture of
    experts, the top k experts' gate, up and down projections: 3 x intermediate x hidden each, whatever
    their layout; at tensor parallel size 1, where every expert is local)."""
    from workers.layers.embedding import ParallelLMHead
    from workers.layers.linear import ReplicatedLinear, RowParallelLinear, _ColumnShards
    from workers.layers.moe import FusedMoE

    total = 0
    for module in model.modules():
        if isinstance(module, (ReplicatedLinear, _ColumnShards, RowParallelLinear)):
            total += module.weight.numel()
        elif isinstance(module, FusedMoE):
            total += module.top_k * 3 * module.intermediate * module.hidden_size
        elif isinstance(module, ParallelLMHead):
            total += (module.weight if module.packed_weight is None else module.packed_weight).numel()
    return 2.0 * rows * total


def _fma_peak() -> float | None:
    """The compiled kernels' FMA peak per core (GFLOP/s, benchmarks/gemm_peak.py), None without them."""
    from kernels.cpu import load

    ops = load()
    if ops is None or not hasattr(ops, "fma_peak"):
        return None
    return max(float(ops.fma_peak(200_000, False)) for _ in range(10))


MAX_BATCHED_TOKENS = SchedulerConfig().max_num_batched_tokens  # the engine's default budget of tokens a step


def check_shared_prefix(shared_prefix: int, prompt_len: int, names: tuple[str, str] = ("shared_prefix", "prompt_len")
                        ) -> None:
    """Each sequence's prompt is the shared prefix and at least one token of its own; ``names``: what the
    caller calls the two (the function's arguments, or the CLI's flags)."""
    if not 0 <= shared_prefix < prompt_len:
        raise ValueError(f"{names[0]} ({shared_prefix}) must be at least 0 and below {names[1]} ({prompt_len}), "
                         f"since each prompt adds at least one token of its own to the shared prefix")


def profile_step(model: str, *, num_seqs: int = 64, prompt_len: int = 544, shared_prefix: int = 512,
                 steps: int = 20, threads: int = 2, block_size: int = 16, attention_backend: str = "auto",
                 cascade: bool = True, kv_cache_dtype: str = "auto", kv_gib: float | None = None,
                 cpu_matmul_precision: str = "highest") -> dict:
    from engine import LLM, SamplingParams
    from engine.sampling_params import RequestOutputKind

    check_shared_prefix(shared_prefix, prompt_len)
    torch.set_num_threads(threads)
    rng = random.Random(0)
    vocab_hi = 4000
    prefix = [1] + [rng.randrange(5, vocab_hi) for _ in range(max(0, shared_prefix - 1))]
    # every sequence decodes through the start (the later prompts' prefills, a budget of batched tokens a
    # step, beside the decodes of those started) and both profiled passes: none may finish before
    start_steps = math.ceil(num_seqs * prompt_len / max(1, MAX_BATCHED_TOKENS - num_seqs)) + 2
    params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 16 + start_steps, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    with LLM(model=model, max_num_seqs=num_seqs, max_num_batched_tokens=MAX_BATCHED_TOKENS, block_size=block_size,
             attention_backend=attention_backend,
             cascade_attention=cascade, max_model_len=prompt_len + params.max_tokens + block_size,
             kv_cache_dtype=kv_cache_dtype, cpu_matmul_precision=cpu_matmul_precision,
             kv_cache_memory_bytes=None if kv_gib is None else int(kv_gib * 2**30)) as llm:
        core = llm.core
        for i in range(num_seqs):
            own = [rng.randrange(5, vocab_hi) for _ in range(max(1, prompt_len - len(prefix)))]
            core.add_request(f"p{i}", prefix + own, params)
        while not (len(core.scheduler.running) == num_seqs and all(r.num_output_tokens for r in core.scheduler.running)):
            finished = [out for out in core.step() if out.finished]
            if finished:
                reason = finished[0].outputs[0].finish_reason
                raise RuntimeError(f"a sequence finished ({reason}) before all {num_seqs} were decoding: the KV pool "
                                   f"must hold {num_seqs} x {prompt_len + params.max_tokens} tokens at once (give "
                                   f"more --kv-gib)")
        from torch.profiler import ProfilerActivity, profile

        with _instrumented(core) as timers:
            start = time.perf_counter()
            for _ in range(steps):
                core.step()
            wall = time.perf_counter() - start
            plain = dict(timers.total)
            timers.total.clear()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    core.step()
            profiled = dict(timers.total)
        runner = core.executor.worker.runner
        backend = runner.attention_backend.name
        products = runner.matmul  # "bf16x3" or "float32" (what the setting gave on this CPU)
        matmul_flops = _linear_flops(runner.model, num_seqs)
        cascade_steps = runner.batch.num_cascade_steps
    families: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        families[_op_family(event.key, backend)] += event.self_cpu_time_total / 1e6
    op_total = sum(families.values())
    ms = lambda s: 1000 * s / steps  # noqa: E731
    phases = {phase: ms(plain.get(phase, 0.0)) for phase in PHASES}
    # the profiled pass splits forward + logits into operator self times and the Python and dispatch
    # around them; scaled to the unprofiled pass's forward + logits time (the profiler slows both)
    forward = plain.get("forward", 0.0) + plain.get("logits", 0.0)
    profiled_forward = profiled.get("forward", 0.0) + profiled.get("logits", 0.0)
    parts = dict(families)
    parts["python and dispatch"] = max(0.0, profiled_forward - op_total) + families.get("python and dispatch", 0.0)
    scale = forward / max(profiled_forward, op_total) if op_total else 0.0
    split = {family: ms(seconds * scale) for family, seconds in parts.items()}
    step_ms = ms(wall)
    phases["other"] = step_ms - sum(phases.values())
    return {
        "model": model, "num_seqs": num_seqs, "prompt_len": prompt_len, "shared_prefix": shared_prefix,
        "threads": threads, "block_size": block_size, "attention_backend": backend, "cascade": cascade,
        "kv_cache_dtype": kv_cache_dtype, "cpu_matmul": products,
        "cascade_steps": cascade_steps, "steps": steps, "step_ms": step_ms,
        "tokens_per_s": num_seqs / (step_ms / 1000), "phases_ms": phases, "forward_ops_ms": split,
        "profiled_op_s": op_total, "matmul_flops": matmul_flops, "fma_peak_per_core": _fma_peak(),
    }


def format_profile(result: dict) -> str:
    step = result["step_ms"]
    lines = [
        f"{result['num_seqs']} sequences decoding, {result['prompt_len']}-token prompts ({result['shared_prefix']} "
        f"shared), {result['threads']} threads, attention backend {result['attention_backend']}, KV "
        f"{result.get('kv_cache_dtype', 'auto')}, linear products {result.get('cpu_matmul', 'float32')}"
        f"{'' if result['cascade'] else ', no shared-prefix attention'}",
        f"decode step {step:.2f} ms = {result['tokens_per_s']:.0f} tok/s",
        "",
        "| phase | ms/step | share |", "|---|---:|---:|",
    ]
    for phase, value in result["phases_ms"].items():
        lines.append(f"| {phase} | {value:.2f} | {value / step:.1%} |")
        if phase == "logits":
            for family, fvalue in sorted(result["forward_ops_ms"].items(), key=lambda kv: -kv[1]):
                lines.append(f"| &nbsp;&nbsp;{family} | {fvalue:.2f} | {fvalue / step:.1%} |")
    matmul_ms = result["forward_ops_ms"].get("matmul", 0.0)
    outside = step - matmul_ms
    lines.append(f"\noutside the matrix products: {outside:.2f} ms/step ({outside / step:.1%})")
    if matmul_ms > 0 and result.get("matmul_flops"):
        gflops = result["matmul_flops"] / (matmul_ms / 1000) / 1e9
        line = f"matrix products: {gflops:.1f} GFLOP/s"
        if result.get("cpu_matmul") == "bf16x3":
            # three bfloat16 products on the tiles: float32's FMA peak does not bound them
            line += " (float32-equivalent; bf16x3, which float32's FMA peak does not bound)"
        elif result.get("fma_peak_per_core"):
            peak = result["fma_peak_per_core"] * result["threads"]
            line += f" = {gflops / peak:.0%} of the FMA peak ({result['fma_peak_per_core']:.1f} GFLOP/s per core x {result['threads']})"
        lines.append(line)
    return "\n".join(lines)


def run_profile_step(args: argparse.Namespace) -> int:
    from workers.model_source import resolve_model

    try:  # before the model is resolved (the default one may be built first)
        check_shared_prefix(args.shared_prefix, args.prompt_len, names=("--shared-prefix", "--prompt-len"))
    except ValueError as exc:
        raise SystemExit(f"kvserve profile-step: {exc}") from None
    args.model = str(resolve_model(args.model))  # a directory, a Hugging Face repo id, or the default
    result = profile_step(args.model, num_seqs=args.num_seqs, prompt_len=args.prompt_len,
                          shared_prefix=args.shared_prefix, steps=args.steps, threads=args.threads,
                          block_size=args.block_size, attention_backend=args.attention_backend,
                          cascade=not args.no_cascade, kv_cache_dtype=args.kv_cache_dtype, kv_gib=args.kv_gib,
                          cpu_matmul_precision=args.cpu_matmul_precision)
    print(format_profile(result))
    return 0
