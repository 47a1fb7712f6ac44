"""`kvserve bench-hybrid-kv`: what releasing the sliding-window layers' blocks buys (``engine.kv_layout``),
on a Gemma-3-shaped model, window layers released ("hybrid") against treated as global ("plain",
``disable_hybrid_kv_cache_manager=True``).

1. **KV bytes held per long sequence**, by the engine: one prompt of ``--seq-len`` tokens through a real
   engine on the model, the pool's pages held once its prompt is computed (``stats()``:
   ``num_blocks_in_use``) times the bytes of a page on every rank (``kv_bytes_per_block_per_rank``);
   and the greedy tokens of both layouts, which must be the same.
2. **The most concurrent long sequences a fixed pool holds**: the scheduler itself, with ranks that
   compute nothing (the pool's accounting is the scheduler's alone), on ``--kv-gib`` of KV per rank
   sized as the engine sizes it (the page bytes measured in 1.): ``--num-seqs`` requests of
   ``--seq-len`` prompt tokens and ``--decode-tokens`` out, all at once; the most that run at the same
   time, the preemptions, and the steps it takes.

The model: the ``gemma3`` ``small`` preset (12 layers, five sliding-window layers per global one, 2 KV
heads of 128) with its context raised to the sequence and its window set by ``--window`` (Gemma 3's is
512 at 1B, 1024 from 4B): a Gemma-3-shaped layout at a size this machine runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from engine.kv_layout import KVLayout
from engine.messages import ModelRunnerOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.window_kv import check_pool_fits

LAYOUTS = ("hybrid", "plain")


def gemma3_shaped(seq_len: int, window: int, root: Path) -> Path:
    """The gemma3 small checkpoint with ``max_position_embeddings`` >= seq_len + 64 and ``window``."""
    from workers.model_builder import ensure_model

    base = ensure_model("gemma3", "small")
    out = root / f"gemma3-small-{seq_len}-{window}"
    if not (out / "config.json").exists():
        shutil.copytree(base, out, dirs_exist_ok=True)
        config = json.loads((out / "config.json").read_text())
        config["max_position_embeddings"] = max(config["max_position_embeddings"], seq_len + 64)
        config["sliding_window"] = window
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def held_by_one_sequence(model: str, seq_len: int, block_size: int, max_tokens: int, hybrid: bool) -> dict:
    """One prompt of ``seq_len`` tokens through the engine: pages held after its prompt, their bytes."""
    from engine import LLM

    prompt = [(7 * i + 3) % 4000 + 10 for i in range(seq_len)]
    start = time.perf_counter()
    with LLM(model=model, block_size=block_size, max_model_len=seq_len + max_tokens, enable_prefix_caching=False,
             num_kv_blocks=8 * -(-(seq_len + max_tokens) // block_size) + 1,
             disable_hybrid_kv_cache_manager=not hybrid) as llm:
        llm.generate({"prompt_token_ids": prompt[:32]}, SamplingParams(temperature=0.0, max_tokens=1))
        core = llm.core
        pool = core.scheduler.kv.block_pool
        seen: list[int] = []
        step = core.step

        def counting_step():  # pages held after each step (the warm-up's request is gone by now)
            out = step()
            seen.append(pool.num_used_blocks)
            return out

        core.step = counting_step
        [out] = llm.generate({"prompt_token_ids": prompt},
                             SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        stats = llm.stats()
    page_bytes = stats["kv_bytes_per_block_per_rank"]  # one rank: the engine's whole pool
    # after the last step but one: the sequence decoding past its prompt, its holds released behind
    # the window at that step's start (the last step finishes it and frees everything)
    held = seen[-2]
    return {"layout": "hybrid" if hybrid else "plain", "pages_held": held, "bytes_per_page": page_bytes,
            "kv_bytes_held": held * page_bytes, "peak_pages": max(seen), "window_groups": stats["kv_window_groups"],
            "token_ids": list(out.outputs[0].token_ids), "seconds": time.perf_counter() - start}


def concurrent_sequences(layout: KVLayout, num_pages: int, block_size: int, seq_len: int, max_tokens: int,
                         num_seqs: int, max_num_batched_tokens: int) -> dict:
    """The scheduler over ``num_pages`` with ranks that compute nothing: every request admitted at once."""
    max_len = seq_len + max_tokens
    check_pool_fits(num_pages, block_size, max_len, layout, max_num_batched_tokens)
    scheduler = Scheduler(num_kv_blocks=num_pages, block_size=block_size, enable_prefix_caching=True,
                          max_num_seqs=256, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_len,
                          kv_layout=layout)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_seqs):  # distinct prompts: no prefix hits
        prompt = [(i * 7919 + j * 31) % 50000 + 1 for j in range(seq_len)]
        scheduler.add_request(Request(f"r{i}", prompt, params, eos_token_ids=frozenset(), block_size=block_size,
                                      max_tokens=max_tokens))
    most = steps = 0
    held: list[int] = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        steps += 1
        most = max(most, len(scheduler.running))
        ids = [*[r.req_id for r in output.scheduled_new_reqs], *[r.req_id for r in output.scheduled_cached_reqs]]
        sampled = []
        for req_id in ids:
            request = scheduler.requests[req_id]
            sampled.append([1] if request.num_computed_tokens >= request.num_tokens else [])
        held.extend(scheduler.kv.pages_held(r.request_id) for r in scheduler.running  # decoding
                    if r.num_computed_tokens > seq_len)
        scheduler.update_from_output(output, ModelRunnerOutput(ids, sampled, [None] * len(ids)))
    return {"layout": "hybrid" if layout.hybrid else "plain", "pages": num_pages, "most_running": most,
            "preemptions": scheduler.stats.num_preemptions, "steps": steps,
            "pages_per_decoding_sequence": max(held) if held else 0}


def run(args: argparse.Namespace) -> dict:
    from engine.config import ModelConfig

    if args.max_tokens < 3:
        raise ValueError(f"--max-tokens must be at least 3, got {args.max_tokens}")
    root = Path(args.work_dir)
    root.mkdir(parents=True, exist_ok=True)
    model = args.model or str(gemma3_shaped(args.seq_len, args.window, root))
    config = ModelConfig.from_dir(model)
    hybrid_layout = KVLayout.for_model(config.hf_config, config.architecture, True, args.seq_len + args.max_tokens)
    plain_layout = KVLayout.plain(hybrid_layout.num_layers)
    per_sequence = [held_by_one_sequence(model, args.seq_len, args.block_size, args.max_tokens, hybrid)
                    for hybrid in (True, False)]
    same_tokens = per_sequence[0].pop("token_ids") == per_sequence[1].pop("token_ids")
    pool_bytes = int(args.kv_gib * 2**30)
    capacity = []
    for layout, measured in zip((hybrid_layout, plain_layout), per_sequence):
        pages = pool_bytes // measured["bytes_per_page"]
        capacity.append({**concurrent_sequences(layout, pages, args.block_size, args.seq_len, args.decode_tokens,
                                                args.num_seqs, args.max_num_batched_tokens),
                         "kv_bytes": pool_bytes})
    return {"model": model, "layout": hybrid_layout.describe(), "seq_len": args.seq_len, "window": hybrid_layout.window,
            "block_size": args.block_size, "same_greedy_tokens": same_tokens, "per_sequence": per_sequence,
            "held_ratio": per_sequence[0]["kv_bytes_held"] / per_sequence[1]["kv_bytes_held"],
            "capacity": capacity, "capacity_ratio": capacity[0]["most_running"] / max(capacity[1]["most_running"], 1)}


def add_bench_hybrid_kv_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a model directory (default: the Gemma-3-shaped one built here)")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--window", type=int, default=1024, help="the built model's sliding window")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens out of each request (at least 3)")
    parser.add_argument("--decode-tokens", type=int, default=512,
                        help="tokens out of each request of the capacity run (long enough that they overlap)")
    parser.add_argument("--kv-gib", type=float, default=1.0, help="KV bytes per rank of the capacity run")
    parser.add_argument("--num-seqs", type=int, default=64, help="requests of the capacity run")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--work-dir", default=str(Path.home() / ".cache" / "kvserve" / "bench-hybrid-kv"))
    parser.add_argument("--out", default=None, help="write the JSON report here")


def run_bench_hybrid_kv(args: argparse.Namespace) -> int:
    report = run(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    seq = {r["layout"]: r for r in report["per_sequence"]}
    cap = {r["layout"]: r for r in report["capacity"]}
    print(f"KV held by one {report['seq_len']}-token sequence: hybrid {seq['hybrid']['kv_bytes_held'] / 2**20:.1f} MiB, "
          f"plain {seq['plain']['kv_bytes_held'] / 2**20:.1f} MiB ({report['held_ratio']:.2f}x); most concurrent "
          f"sequences in {args.kv_gib} GiB: hybrid {cap['hybrid']['most_running']}, plain {cap['plain']['most_running']}; "
          f"same greedy tokens: {report['same_greedy_tokens']}")
    return 0 if report["same_greedy_tokens"] else 1
