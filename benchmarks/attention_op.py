"""`python -m benchmarks.attention_op`: the compiled CPU paged-attention op alone, one step of decodes
or of fresh prefills over ``--layers`` layers' pools, beside this machine's memory read rate.

Decodes: ``--seqs`` sequences of ``--context`` keys, one query token each; the pools of all layers
together are far larger than the caches when the defaults are kept (64 x 288 keys, 8 layers, 2 KV heads
of 128: 302 MB in float32), so each pass reads the KV from memory, and the rate is reported as the
pool bytes read a second (a quantized pool's bytes, codes and scales, for its format). Prefills:
``--seqs`` prompts of ``--context`` tokens with nothing cached, reported as the causal products'
GFLOP/s (4 x head_dim x heads flops for each visible query-key pair). A sequence's blocks follow each
other in the pool (``--shuffle`` scatters them as a long-running pool does).

Each format and thread count is timed ``--repeats`` times (best and median of the whole pass over the
layers); before timing, the op's output on the first layer, every sequence of it, is set against the
float64 reference over the same (dequantized) pool, and the run stops if it is off by more than
``MAX_ERROR``. The memory read rate is torch's ``sum`` of a ``--read-gib`` GiB tensor (1 by default) at
each thread count: what a stream reads, the bound that decodes of a float32 pool approach. The
caller's torch threads are set back at the end.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time

import torch

from benchmarks.op_report import comma_ints, emit

FORMATS = ("auto", "fp8_e4m3", "fp8_e5m2", "int8")
MAX_ERROR = 1e-4  # the output against the float64 reference over the same pool's values


def _backend():
    from kernels.backends import select_backend
    from kernels.cpu import load, load_error

    if load() is None:
        raise SystemExit(f"the compiled CPU kernels are not available here: {load_error()}")
    return select_backend("cpu", torch.device("cpu"))[0]


def read_rate(threads: int, gib: float = 1.0, repeats: int = 5) -> float:
    """GB/s of torch's sum over a ``gib`` GiB float32 tensor on ``threads`` threads (the best of the
    repeats); the caller sets the threads back."""
    torch.set_num_threads(threads)
    x = torch.ones(int(gib * (1 << 30)) // 4)
    x.sum()
    best = min(_timed(x.sum) for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Step:
    """One step's inputs and ``layers`` layers' pools in format ``fmt``."""

    def __init__(self, mode: str, fmt: str, seqs: int, context: int, layers: int, heads: int, kv_heads: int,
                 head_dim: int, block_size: int, shuffle: bool, seed: int = 0) -> None:
        from kernels import PagedAttentionMetadata
        from kernels.kv_quant import is_quantized, quantize

        gen = torch.Generator().manual_seed(seed)
        per_seq = -(-context // block_size)
        num_blocks = seqs * per_seq + 1  # block 0 is the null block
        ids = list(range(1, num_blocks))
        if shuffle:
            random.Random(seed).shuffle(ids)
        self.tables = [ids[s * per_seq:(s + 1) * per_seq] for s in range(seqs)]
        q_len = 1 if mode == "decode" else context
        self.meta = PagedAttentionMetadata.build([q_len] * seqs, [context] * seqs, self.tables, block_size,
                                                 backend=_backend(), kv_format=fmt)
        self.fmt, self.mode, self.q_len, self.context = fmt, mode, q_len, context
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.pools = []
        for _ in range(layers):
            k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
            self.pools.append((quantize(k, fmt), quantize(v, fmt)) if is_quantized(fmt) else (k, v))
        qkv = torch.randn(seqs * q_len, heads + 2 * kv_heads, head_dim, generator=gen)
        self.query = qkv[:, :heads]  # strided, as the model's qkv split makes it
        self.key, self.value = qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
        self.scale = 1 / math.sqrt(head_dim)
        self.heads, self.kv_heads, self.head_dim, self.seqs = heads, kv_heads, head_dim, seqs

    def run(self, layer: int) -> torch.Tensor:
        from kernels import paged_attention

        k_pool, v_pool = self.pools[layer]
        return paged_attention(self.query, self.key, self.value, k_pool, v_pool, self.meta, self.scale)

    def run_all(self) -> None:
        for layer in range(len(self.pools)):
            self.run(layer)

    def check(self) -> float:
        """The largest difference of the first layer's output from the float64 reference over the pool's
        values (after the op stored the step's keys and values), over every sequence."""
        from kernels.kv_quant import dequantize_pool
        from kernels.reference import naive_causal_attention

        out = self.run(0)
        k_pool, v_pool = (dequantize_pool(p, self.fmt, torch.float32) for p in self.pools[0])
        worst = 0.0
        for s in range(self.seqs):
            idx = torch.tensor(self.tables[s])
            k = k_pool[idx].reshape(-1, self.kv_heads, self.head_dim)[:self.context]
            v = v_pool[idx].reshape(-1, self.kv_heads, self.head_dim)[:self.context]
            rows = slice(s * self.q_len, (s + 1) * self.q_len)
            ref = naive_causal_attention(self.query[rows].double(), k, v, self.scale)
            worst = max(worst, (out[rows].double() - ref.double()).abs().max().item())
        return worst

    def bytes_read(self) -> int:
        """Pool bytes a pass reads (every layer's K and V of every sequence's context)."""
        k_pool = self.pools[0][0]
        row = k_pool.shape[-1] * k_pool.element_size()
        return 2 * len(self.pools) * self.seqs * self.context * self.kv_heads * row

    def flops(self) -> float:
        """Causal products' flops of a pass: q.k and p.v for every visible query-key pair."""
        pairs = sum(self.context - self.q_len + i + 1 for i in range(self.q_len))
        return 4.0 * self.head_dim * self.heads * pairs * self.seqs * len(self.pools)


def measure(mode: str, formats, threads, seqs: int, context: int, layers: int, heads: int, kv_heads: int,
            head_dim: int, block_size: int, repeats: int, shuffle: bool, read_gib: float = 1.0) -> dict:
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not divide into {kv_heads} KV heads")
    result = {"mode": mode, "seqs": seqs, "context": context, "layers": layers, "heads": heads,
              "kv_heads": kv_heads, "head_dim": head_dim, "block_size": block_size, "shuffle": shuffle,
              "read_gib": read_gib, "read_gbps": {}, "runs": []}
    threads_before = torch.get_num_threads()
    try:
        for t in threads:
            result["read_gbps"][t] = read_rate(t, read_gib)
        for fmt in formats:
            step = Step(mode, fmt, seqs, context, layers, heads, kv_heads, head_dim, block_size, shuffle)
            for t in threads:
                torch.set_num_threads(t)
                error = step.check()
                if not error <= MAX_ERROR:
                    raise RuntimeError(f"the op's output is {error:.3g} from the reference ({fmt}, {t} threads)")
                step.run_all()  # warm: the kernels' scratch, the pages of the output
                times = sorted(_timed(step.run_all) for _ in range(repeats))
                best, median = times[0], statistics.median(times)
                run = {"format": fmt, "threads": t, "best_ms": best * 1e3, "median_ms": median * 1e3,
                       "max_error": error}
                if mode == "decode":
                    run["gbps"] = step.bytes_read() / best / 1e9
                else:
                    run["gflops"] = step.flops() / best / 1e9
                result["runs"].append(run)
            del step
    finally:
        torch.set_num_threads(threads_before)
    return result


def format_table(result: dict) -> str:
    decode = result["mode"] == "decode"
    lines = [f"{result['mode']}: {result['seqs']} sequences x {result['context']} keys, {result['layers']} "
             f"layers, {result['heads']} heads / {result['kv_heads']} KV heads of {result['head_dim']}, "
             f"blocks of {result['block_size']}{' (shuffled)' if result['shuffle'] else ''}", "",
             "| format | threads | best ms | median ms | " + ("pool GB/s | of the read rate |" if decode else "GFLOP/s |"),
             "|---|---:|---:|---:|---:|" + ("---:|" if decode else "")]
    for run in result["runs"]:
        rate = result["read_gbps"][run["threads"]]
        tail = f"{run['gbps']:.1f} | {run['gbps'] / rate:.0%} |" if decode else f"{run['gflops']:.1f} |"
        lines.append(f"| {run['format']} | {run['threads']} | {run['best_ms']:.2f} | {run['median_ms']:.2f} | {tail}")
    lines.append("")
    lines.append(f"memory read rate (torch sum of {result['read_gib']:g} GiB): " + ", ".join(
        f"{gbps:.1f} GB/s at {t} thread{'s' if t > 1 else ''}" for t, gbps in result["read_gbps"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attention_op", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("decode", "prefill"), default="decode")
    parser.add_argument("--formats", default="auto", help=f"comma-separated, of {', '.join(FORMATS)}")
    parser.add_argument("--threads", type=comma_ints, default=(1, 2), help="comma-separated thread counts")
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=288, help="keys per sequence (the prompt at --mode prefill)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15, help="passes timed; the best and median are reported")
    parser.add_argument("--shuffle", action="store_true", help="scatter each sequence's blocks over the pool")
    parser.add_argument("--read-gib", type=float, default=1.0, help="size of the memory read-rate tensor")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    formats = tuple(f for f in args.formats.split(",") if f)
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        parser.error(f"--formats takes {', '.join(FORMATS)}, not {','.join(unknown) or 'nothing'}")
    for name in ("seqs", "context", "layers", "heads", "kv_heads", "head_dim", "block_size", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    if not args.threads or min(args.threads) < 1:
        parser.error("--threads must list thread counts of at least 1")
    if not args.read_gib > 0:
        parser.error(f"--read-gib must be above 0, not {args.read_gib:g}")
    if args.heads % args.kv_heads:
        parser.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    result = measure(args.mode, formats, args.threads, args.seqs, args.context, args.layers, args.heads,
                     args.kv_heads, args.head_dim, args.block_size, args.repeats, args.shuffle, args.read_gib)
    return emit(result, format_table, args.json)


if __name__ == "__main__":
    sys.exit(main())
