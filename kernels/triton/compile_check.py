"""``python -m kernels.triton.compile_check``: the Triton kernels compiled for real NVIDIA targets
(sm_80 and sm_90 by default) on a machine with no GPU, each variant's shared memory checked against
the target's per-block limit. Run without ``TRITON_INTERPRET`` (the compiled path's constexprs:
tile sizes and ``tl.dot`` are not the interpreter's).

What is enumerated (every launch the ops would make, from the code that makes them, over meta
tensors, nothing launched; see ``kernels.triton.warmup``):

- attention (KV store, paged attention, split merge): float16, bfloat16 and float32; head sizes 64,
  80, 96, 128 and 256; GQA ratios 1-8 over 1, 2 and 8 KV heads; block sizes 1, 8, 16 and 32; every
  split count the planner can choose at a 4096-token context on a 132-SM device (1-32), both tile
  shapes (decodes, prefill chunks), deterministic mode (which launches the decode tile, unsplit, for
  every row). The CUDA-graph buckets launch the decode tile at one of those split counts: nothing
  more to compile. Over quantized pools (uint8, ``kernels.kv_quant``): each format (fp8 e4m3, fp8
  e5m2, int8) at head sizes 128 and 256 in bfloat16 (GQA 4 over 8 KV heads, block size 16), both
  tiles, every split count; the store of each.
- the fused mixture-of-experts (gate|up and down, ``kernels.triton.moe``) at the widths of
  Mixtral-8x7B (also at tensor-parallel size 2) and Qwen3-30B-A3B (also at expert-parallel size 2).
- layer ops (RMSNorm with and without the residual, neox rotary, SiLU-and-multiply, and the
  batch-invariant linear of ``deterministic``) at the widths of OPT-125m, Qwen2-0.5B, Llama-3.2-1B,
  Gemma-2-2B, Phi-2, Phi-3-mini, Qwen2.5-7B, Llama-3-8B / Mistral-7B (also at tensor-parallel size
  2), in the three dtypes.

That is a few thousand distinct variants; compiling each for two targets would take over an hour
here. What is compiled is a cover of them, picked greedily in a fixed order: every (dtype, head
size, tile rows, quantized format) of attention, every (dtype, head size) of the merge, (dtype, head size,
quantized format) of the store, every (dtype,
block width, residual) of the norm, (dtype, half width) of rotary, (dtype, width) of SiLU, (dtype,
bias) of the linear, (dtype, routing weight) of the fused MoE — and every value any one argument takes anywhere in the full set (each
constexpr value, each dtype, each integer or pointer specialisation) at least once. Compiles are
cached per process by variant.

Prints a JSON report (``--out`` writes it to a file too) and exits 1 if any variant fails to
compile or needs more shared memory than its target has.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time

import torch

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIMS = (64, 80, 96, 128, 256)
GQA_RATIOS = tuple(range(1, 9))
KV_HEADS = (1, 2, 8)
BLOCK_SIZES = (1, 8, 16, 32)
MAX_MODEL_LEN = 4096
# quantized KV pools (``kernels.kv_quant``): each format's store and attention (both tiles, every split count)
# at these head sizes, in bfloat16, GQA 4 over 8 KV heads, block size 16
QUANT_FORMATS = ("fp8_e4m3", "fp8_e5m2", "int8")
QUANT_HEAD_DIMS = (128, 256)
QUANT_DTYPE = torch.bfloat16
TARGET_PROGRAMS = 2 * 132  # an H100 SXM's multiprocessors, twice: the planner's largest split counts
# per-block shared memory (opt-in maximum) of the targets
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
# (name, hidden, intermediate, heads, kv heads, head size, vocabulary, qkv bias) of one rank
MODELS = (
    ("opt-125m", 768, 3072, 12, 12, 64, 50272, True),
    ("qwen2-0.5b", 896, 4864, 14, 2, 64, 151936, True),
    ("llama-3.2-1b", 2048, 8192, 32, 8, 64, 128256, False),
    ("gemma-2-2b", 2304, 9216, 8, 4, 256, 256000, False),
    ("phi-2", 2560, 10240, 32, 32, 80, 51200, True),
    ("phi-3-mini", 3072, 8192, 32, 32, 96, 32064, False),
    ("qwen2.5-7b", 3584, 18944, 28, 4, 128, 152064, True),
    ("llama-3-8b", 4096, 14336, 32, 8, 128, 128256, False),
    ("mistral-7b", 4096, 14336, 32, 8, 128, 32000, False),
    ("llama-3-8b-tp2", 4096, 7168, 16, 4, 128, 64128, False),
)

# (name, hidden, expert intermediate, experts, top k) of one rank's mixture-of-experts layers
MOE_MODELS = (
    ("mixtral-8x7b", 4096, 14336, 8, 2),
    ("mixtral-8x7b-tp2", 4096, 7168, 8, 2),
    ("qwen3-30b-a3b", 2048, 768, 128, 8),
    ("qwen3-30b-a3b-ep2", 2048, 768, 64, 8),
)


def enumerate_all() -> list:
    """Every launch of the grid above (one per distinct variant)."""
    from kernels.triton.backend import AttentionShape, TritonAttentionBackend
    from kernels.triton.warmup import attention_launches, distinct, layer_launches, moe_launches

    launches = []
    backend = TritonAttentionBackend(target_programs=TARGET_PROGRAMS)
    for dtype in DTYPES:
        for head_dim in HEAD_DIMS:
            for kv_heads in KV_HEADS:
                for ratio in GQA_RATIOS:
                    for block_size in BLOCK_SIZES:
                        for deterministic in (False, True):
                            shape = AttentionShape(dtype, ratio * kv_heads, kv_heads, head_dim, block_size, 256,
                                                   MAX_MODEL_LEN, deterministic)
                            launches += distinct(attention_launches(backend, shape)).values()
        if dtype == QUANT_DTYPE:
            for kv_format in QUANT_FORMATS:
                for head_dim in QUANT_HEAD_DIMS:
                    shape = AttentionShape(dtype, 32, 8, head_dim, 16, 256, MAX_MODEL_LEN, False, kv_format)
                    launches += distinct(attention_launches(backend, shape)).values()
        for _, hidden, inter, heads, kv_heads, head_dim, vocab, bias in MODELS:
            launches += layer_launches(dtype, hidden, inter, heads, kv_heads, head_dim, vocab, bias,
                                       deterministic=True)
        for _, hidden, inter, experts, top_k in MOE_MODELS:
            launches += moe_launches(dtype, hidden, inter, experts, top_k)
    return list(distinct(launches).values())


def _dtype(launch) -> str:
    return next(spec[0] for spec in launch.key[1] if str(spec[0])[:3] in ("*fp", "*bf"))


def _critical(launch) -> tuple:
    """What decides a variant's resources (registers, shared memory, compile time)."""
    c = launch.constexprs
    per_kernel = {
        "_paged_attention_kernel": lambda: (c["HEAD_DIM"], c["BLOCK_Q"] * c["GROUP_P2"]),
        "_merge_splits_kernel": lambda: (c["HEAD_DIM"],),
        "_store_kv_kernel": lambda: (c["HEAD_DIM"],),
        "_rms_norm_kernel": lambda: (c["BLOCK"], c["HAS_RESIDUAL"]),
        "_silu_and_mul_kernel": lambda: (c["BLOCK"],),
        "_rotary_neox_kernel": lambda: (c["HALF"],),
        "_linear_kernel": lambda: (c["HAS_BIAS"],),
        "_fused_moe_kernel": lambda: (c["MUL_ROUTED_WEIGHT"],),
    }
    # a quantized pool's variants are their own (format 0 passes no KV_FORMAT: its tuples as they were)
    quantized = (c["KV_FORMAT"],) if c.get("KV_FORMAT") else ()
    return (launch.name, _dtype(launch)) + per_kernel[launch.name]() + quantized


def cover(launches: list) -> list:
    """A subset holding every critical tuple and every single argument value of ``launches``: the
    launch adding the most features not yet held, first-seen order breaking ties."""
    features = []
    for launch in launches:
        f = {("critical",) + _critical(launch)}
        f |= {("arg", launch.name, i, repr(spec)) for i, spec in enumerate(launch.key[1])}
        features.append(f)
    wanted = set().union(*features)
    chosen = []
    while wanted:
        best = max(range(len(launches)), key=lambda i: (len(features[i] & wanted), -i))
        chosen.append(launches[best])
        wanted -= features[best]
    return chosen


def _compile_all(launches: list, capability: int, conn) -> None:
    from triton.backends.compiler import GPUTarget

    from kernels.triton.warmup import compile_for_target

    target = GPUTarget("cuda", capability, 32)
    results = []
    for launch in launches:
        start = time.perf_counter()
        row = {"kernel": launch.name, "target": f"sm_{capability}", "critical": repr(_critical(launch)),
               "constexprs": {k: v for k, v in launch.constexprs.items()}}
        try:
            compiled = compile_for_target(launch, target)
            row.update(shared=compiled.metadata.shared, num_warps=compiled.metadata.num_warps,
                       cubin_bytes=len(compiled.asm.get("cubin", b"")))
        except Exception as exc:  # noqa: BLE001 (every rejection is reported)
            row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        row["seconds"] = time.perf_counter() - start
        results.append(row)
    conn.send(results)
    conn.close()


def run(capabilities: list[int], parallel: bool = False) -> dict:
    start = time.perf_counter()
    every = enumerate_all()
    enumerate_s = time.perf_counter() - start
    chosen = cover(every)
    results: list[dict] = []
    # one process per target (fork: the launches travel as they are); in turn unless ``parallel``
    ctx = multiprocessing.get_context("fork")
    running = []
    for capability in capabilities:
        receive, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_compile_all, args=(chosen, capability, send))
        proc.start()
        running.append((proc, receive))
        if not parallel:
            results += receive.recv()
            proc.join()
    if parallel:
        for proc, receive in running:
            results += receive.recv()
            proc.join()
    for row in results:
        limit = SHARED_LIMIT[int(row["target"][3:])]
        row["shared_limit"] = limit
        if "error" not in row and row["shared"] > limit:
            row["error"] = f"needs {row['shared']} bytes of shared memory, {row['target']} has {limit}"
    per_target = {}
    for row in results:
        t = per_target.setdefault(row["target"], {"variants": 0, "seconds": 0.0, "max_shared": 0, "errors": 0})
        t["variants"] += 1
        t["seconds"] += row["seconds"]
        t["max_shared"] = max(t["max_shared"], row.get("shared", 0))
        t["errors"] += "error" in row
    kinds = {}
    for launch in every:
        kinds.setdefault(launch.name, [0, 0])[0] += 1
    for launch in chosen:
        kinds[launch.name][1] += 1
    return {"distinct_variants": len(every), "compiled_per_target": len(chosen), "enumerate_s": enumerate_s,
            "per_kernel": {k: {"distinct": v[0], "compiled": v[1]} for k, v in kinds.items()},
            "per_target": per_target, "errors": [r for r in results if "error" in r],
            "results": results, "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.triton.compile_check", description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", type=int, default=[80, 90], help="compute capabilities")
    parser.add_argument("--parallel", action="store_true", help="compile the targets at once (a process each)")
    parser.add_argument("--out", help="write the JSON report here too")
    args = parser.parse_args(argv)
    from kernels.triton import ops

    if ops.INTERPRETED:
        print("compile_check: TRITON_INTERPRET=1 is set; run it without (the compiled path's variants)",
              file=sys.stderr)
        return 2
    report = run(args.targets, args.parallel)
    text = json.dumps(report, indent=1, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    summary = {k: report[k] for k in ("distinct_variants", "compiled_per_target", "per_kernel", "per_target",
                                      "enumerate_s", "seconds")}
    print(json.dumps(summary, indent=1))
    for row in report["errors"]:
        print(f"{row['kernel']} {row['target']} {row['critical']}: {row['error']}", file=sys.stderr)
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
