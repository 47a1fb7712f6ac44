"""`kvserve bench-host-tier`: multi-turn conversations through a primary KV pool that holds about a
quarter of their KV, with the host tier off, on, and with a pool that holds everything: prefix-cache
hit rate and output tokens/s of each, and whether the three produced the same (greedy) tokens.

Each configuration is a fresh engine in this process, warmed up with one short request (its prefix
cache, and tier, emptied after), then the workload through ``benchmarks.offline.run_instance``: every
conversation's first turn at once, each later turn the moment the one before it finished. With
``repeat`` rounds the configurations take turns (off, on, unlimited, off, ...: the machine's drift falls
on all of them alike) and each keeps its best round, every round's tok/s listed beside it. The pool's
size comes from the workload: the blocks of every conversation's whole history (last prompt plus its
output), times ``pool_share``; the tier (when on) holds them all."""

from __future__ import annotations

import argparse
import json
import time

from benchmarks.offline import kvserve_engine, run_instance
from benchmarks.workloads import Workload, multi_turn
from engine import SamplingParams

CONFIGS = ("tier-off", "tier-on", "unlimited-pool")


def conversation_blocks(workload: Workload, block_size: int) -> int:
    """Blocks of KV the conversations amount to: each one's last turn holds its whole history."""
    last: dict[int, int] = {}
    for r in workload.requests:
        last[r.user] = max(last.get(r.user, 0), len(r.prompt) + r.output_len)
    return sum(-(-n // block_size) for n in last.values())


def plan(workload: Workload, block_size: int, pool_share: float) -> dict[str, dict]:
    """Engine settings of the three configurations (pool blocks include the null block)."""
    total = conversation_blocks(workload, block_size)
    one_sequence = -(-workload.max_len // block_size)
    small = max(int(round(total * pool_share)), one_sequence) + 1
    return {
        "tier-off": {"num_kv_blocks": small},
        "tier-on": {"num_kv_blocks": small, "num_host_kv_blocks": total},
        "unlimited-pool": {"num_kv_blocks": total + 1},
    }


def run_config(model: str, workload: Workload, block_size: int, settings: dict, **engine_kwargs) -> dict:
    start = time.perf_counter()
    with kvserve_engine(model, enable_prefix_caching=True, block_size=block_size, max_model_len=workload.max_len,
                        **settings, **engine_kwargs) as llm:
        startup = time.perf_counter() - start
        llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        assert llm.reset_prefix_cache()
        before = llm.stats()
        records, elapsed, extra = run_instance(llm, workload)
        after = llm.stats()
    output_tokens = sum(len(r.token_ids) for r in records)
    tier = {k: after[k] - before[k] for k in ("host_kv_cache_hits", "host_kv_cache_offloaded_blocks",
                                               "kv_offload_bytes", "kv_restore_bytes")}
    return {
        **settings,
        "startup_s": startup,
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / elapsed,
        "prefix_cache_hit_rate": extra["prefix_cache_hit_rate"],
        "prefix_cache_hits": extra["prefix_cache_hits"],
        "prefix_cache_queries": extra["prefix_cache_queries"],
        "num_preemptions": extra["num_preemptions"],
        "num_steps": extra["num_steps"],
        "pool_blocks": after["num_kv_blocks"] - 1,  # the blocks the pool got (the null block aside)
        **tier,
        "host_kv_cache_usage": after["host_kv_cache_usage"],
        "token_ids": [r.token_ids for r in records],
    }


def best_rounds(rounds: dict[str, list[dict]]) -> dict[str, dict]:
    """Each configuration's round of the most output tok/s, with every round's beside it
    (``rounds_output_tokens_per_s``)."""
    best = {}
    for name, runs in rounds.items():
        best[name] = dict(max(runs, key=lambda run: run["output_tokens_per_s"]))
        best[name]["rounds_output_tokens_per_s"] = [run["output_tokens_per_s"] for run in runs]
    return best


def bench_host_tier(model: str, *, num_users: int = 16, num_turns: int = 4, output_len: int = 48,
                    block_size: int = 16, pool_share: float = 0.25, configs=CONFIGS, repeat: int = 1,
                    **engine_kwargs) -> dict:
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    workload = multi_turn(model, num_users=num_users, num_turns=num_turns, output_len=output_len)
    settings = plan(workload, block_size, pool_share)
    rounds: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(repeat):
        for name in configs:
            rounds[name].append(run_config(model, workload, block_size, settings[name], **engine_kwargs))
    tokens = [run.pop("token_ids") for runs_ in rounds.values() for run in runs_]
    runs = best_rounds(rounds)
    report = {
        "model": model,
        "workload": {"description": workload.description, "num_requests": len(workload.requests),
                     "num_prompt_tokens": workload.num_prompt_tokens, "block_size": block_size,
                     "conversation_blocks": conversation_blocks(workload, block_size), "pool_share": pool_share,
                     "repeat": repeat},
        "runs": runs,
        "same_tokens": all(t == tokens[0] for t in tokens[1:]),
    }
    if "tier-on" in runs and "unlimited-pool" in runs:
        full = runs["unlimited-pool"]["prefix_cache_hit_rate"]
        report["hit_rate_vs_unlimited"] = runs["tier-on"]["prefix_cache_hit_rate"] / full if full else 0.0
    if "tier-on" in runs and "tier-off" in runs:
        report["tokens_per_s_vs_off"] = runs["tier-on"]["output_tokens_per_s"] / runs["tier-off"]["output_tokens_per_s"]
    return report


def format_host_tier_report(report: dict) -> str:
    w = report["workload"]
    lines = [f"{w['description']}; {w['conversation_blocks']} blocks of {w['block_size']} tokens of conversation "
             f"KV, primary pool {w['pool_share']:.2f} of it; greedy, same tokens in every run: "
             f"{report['same_tokens']}"
             + (f"; {w['repeat']} rounds taking turns, each configuration's best round" if w["repeat"] > 1 else ""),
             "",
             "| config | pool blocks | tier blocks | prefix hit rate | output tok/s | elapsed s | preemptions | "
             "tier hits (tokens) | offloaded MiB | restored MiB | tok/s of every round |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in report["runs"].items():
        lines.append(f"| {name} | {r['num_kv_blocks'] - 1} | {r.get('num_host_kv_blocks', 0)} | "
                     f"{r['prefix_cache_hit_rate']:.3f} | {r['output_tokens_per_s']:.1f} | {r['elapsed_s']:.1f} | "
                     f"{r['num_preemptions']} | {r['host_kv_cache_hits']} | {r['kv_offload_bytes'] / 2**20:.1f} | "
                     f"{r['kv_restore_bytes'] / 2**20:.1f} | "
                     + " / ".join(f"{x:.1f}" for x in r["rounds_output_tokens_per_s"]) + " |")
    if "hit_rate_vs_unlimited" in report:
        lines.append(f"\nhit rate, tier on / unlimited pool: {report['hit_rate_vs_unlimited']:.3f} (target >= 0.9)")
    if "tokens_per_s_vs_off" in report:
        lines.append(f"output tok/s, tier on / tier off: {report['tokens_per_s_vs_off']:.2f}x (target >= 1.5x)")
    return "\n".join(lines)


def add_bench_host_tier_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory or Hugging Face repo id (default: the llama `small` preset)")
    parser.add_argument("--users", type=int, default=16, help="conversations")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation")
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--pool-share", type=float, default=0.25,
                        help="the primary pool's size as a share of the conversations' KV")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--repeat", type=int, default=3,
                        help="rounds, the configurations taking turns; each keeps its best round")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--json", help="also write the report to this file")


def run_bench_host_tier(args: argparse.Namespace) -> int:
    from workers.model_source import resolve_model

    model = str(resolve_model(args.model))
    report = bench_host_tier(model, num_users=args.users, num_turns=args.turns, output_len=args.output_len,
                             block_size=args.block_size, pool_share=args.pool_share, configs=args.configs,
                             repeat=args.repeat, attention_backend=args.attention_backend)
    print(format_host_tier_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
