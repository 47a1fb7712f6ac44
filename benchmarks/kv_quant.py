"""`kvserve bench-kv-quant`: what a quantized KV pool (``kv_cache_dtype``) costs in accuracy and buys in
capacity and speed, each format beside ``auto`` (the model's dtype) on the same checkpoint.

- Accuracy, by teacher forcing: the ``auto`` engine's greedy continuations of the shared-system-prompt
  and multi-turn workloads' prompts are fed back whole to each format's engine with ``prompt_logprobs``,
  so every position is scored on the same tokens: the chosen (``auto``-greedy) token's |Δ logprob|
  against ``auto`` and against Hugging Face transformers (mean, p99, max), and greedy agreement (the
  share of generated positions where that token is still the format's top-1).
- Capacity at equal KV bytes: the blocks each format's pool gets from the same ``--kv-gib`` and the most
  concurrent ``--capacity-len``-token sequences those blocks hold.
- Speed: the multi-turn workload of ``kvserve bench-host-tier`` through a pool of the same bytes in each
  format, sized so that ``auto`` holds ``--pool-share`` of the conversations' KV: prefix hit rate and
  output tok/s, the formats taking turns over ``--repeat`` rounds, each format's best round.
"""

from __future__ import annotations

import argparse
import json
import math

from benchmarks.host_tier import best_rounds, conversation_blocks, plan, run_config
from benchmarks.offline import kvserve_engine
from benchmarks.workloads import Workload, multi_turn, shared_system_prompt
from engine import LLM, SamplingParams

FORMATS = ("auto", "fp8_e4m3", "fp8_e5m2", "int8")


def _scored(llm: LLM, sequences: list[list[int]]) -> list[list[tuple[float, int, float]]]:
    """Per sequence, (logprob, rank, margin) of each token after the first, teacher-forced; margin: the
    best logprob at that position less the second best."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params)
    scored = []
    for s, o in zip(sequences, outs):
        rows = []
        for tok, entry in zip(s[1:], o.prompt_logprobs[1:]):
            best = sorted((lp for lp, rank in entry.values() if rank <= 2), reverse=True)
            rows.append((*entry[tok], best[0] - best[1] if len(best) > 1 else float("inf")))
        scored.append(rows)
    return scored


def load_hf(model: str, attn_implementation: str = "eager"):
    """transformers' model in float32 (eager attention unless another registered one is named)."""
    import torch

    from workers.model_builder import without_triton

    with without_triton():  # transformers' import would leave Triton's exit-time leak report on stderr
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32,
                                                    attn_implementation=attn_implementation).eval()


def hf_log_softmax(hf, sequence: list[int]):
    """The log-softmax over the vocabulary at each position of ``sequence`` but the last: [len - 1, vocab]."""
    import torch

    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([sequence])).logits[0, :-1].float(), dim=-1)


def chosen(log_softmax, sequence: list[int]):
    """Each next token's logprob: [len - 1]."""
    import torch

    return log_softmax.gather(1, torch.tensor(sequence[1:])[:, None])[:, 0]


def _hf_logprobs(model: str, sequences: list[list[int]]) -> list[list[float]]:
    """transformers' log-softmax of each next token, the oracle (float32, eager attention)."""
    hf = load_hf(model)
    return [chosen(hf_log_softmax(hf, s), s).tolist() for s in sequences]


MARGINS = (0.0, 0.1, 0.5, 1.0)  # top-1 minus top-2 logprob of auto at a generated position


def _share(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def _stats(values: list[float]) -> dict:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)] if ordered else 0.0
    return {"mean": sum(values) / max(len(values), 1), "p99": p99, "max": max(values, default=0.0)}


def accuracy(model: str, workload: Workload, formats, block_size: int, hf: bool, **engine_kwargs) -> dict:
    """Teacher-forced scores of every format on ``auto``'s greedy continuations of ``workload``'s prompts."""
    greedy = SamplingParams(temperature=0.0, max_tokens=workload.output_len, ignore_eos=True)
    prompts = workload.prompts
    settings = dict(enable_prefix_caching=False, block_size=block_size, max_model_len=workload.max_len + 1,
                    **engine_kwargs)
    with kvserve_engine(model, kv_cache_dtype="auto", **settings) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    sequences = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    generated = [range(len(p) - 1, len(s) - 1) for p, s in zip(prompts, sequences)]  # score index of each output
    scores = {}
    for fmt in formats:
        with kvserve_engine(model, kv_cache_dtype=fmt, **settings) as llm:
            scores[fmt] = _scored(llm, sequences)
    oracle = _hf_logprobs(model, sequences) if hf else None
    report = {"sequences": len(sequences), "scored_positions": sum(len(s) - 1 for s in sequences),
              "generated_positions": sum(len(g) for g in generated), "formats": {}}
    for fmt in formats:
        rows = scores[fmt]
        vs_auto = [abs(a[0] - b[0]) for r, base in zip(rows, scores["auto"]) for a, b in zip(r, base)]
        agree = [rows[i][j][1] == 1 for i, g in enumerate(generated) for j in g]
        margins = [scores["auto"][i][j][2] for i, g in enumerate(generated) for j in g]
        entry = {"delta_logprob_vs_auto": _stats(vs_auto), "greedy_agreement": sum(agree) / max(len(agree), 1),
                 # agreement where auto's best token led its runner-up by at least the margin: a random
                 # checkpoint's next-token distributions are flat, a top-2 gap of hundredths is common
                 "greedy_agreement_by_margin": {
                     str(m): _share([a for a, g in zip(agree, margins) if g >= m]) for m in MARGINS},
                 "generated_positions_by_margin": {str(m): sum(g >= m for g in margins) for m in MARGINS}}
        if oracle is not None:
            entry["delta_logprob_vs_hf"] = _stats([abs(a[0] - h) for r, o in zip(rows, oracle) for a, h in zip(r, o)])
        report["formats"][fmt] = entry
    return report


def capacity(model: str, formats, block_size: int, kv_bytes: int, seq_len: int, **engine_kwargs) -> dict:
    """Blocks of a pool of ``kv_bytes`` per format, and the ``seq_len``-token sequences they hold at once."""
    out = {}
    for fmt in formats:
        with kvserve_engine(model, enable_prefix_caching=True, kv_cache_dtype=fmt, block_size=block_size,
                            kv_cache_memory_bytes=kv_bytes, max_model_len=seq_len, **engine_kwargs) as llm:
            stats = llm.stats()
        blocks = stats["num_kv_blocks"] - 1  # the null block holds nothing
        out[fmt] = {"num_kv_blocks": blocks, "kv_bytes_per_block": stats["kv_bytes_per_block_per_rank"],
                    "most_sequences": blocks // -(-seq_len // block_size)}
    for fmt in formats:
        out[fmt]["blocks_vs_auto"] = out[fmt]["num_kv_blocks"] / out["auto"]["num_kv_blocks"]
    return out


def speed(model: str, formats, block_size: int, pool_share: float, repeat: int, num_users: int, num_turns: int,
          output_len: int, **engine_kwargs) -> dict:
    """The multi-turn workload through pools of equal bytes (``auto`` holding ``pool_share`` of its KV)."""
    workload = multi_turn(model, num_users=num_users, num_turns=num_turns, output_len=output_len)
    with kvserve_engine(model, enable_prefix_caching=True, block_size=block_size, num_kv_blocks=2,
                        max_model_len=block_size, **engine_kwargs) as llm:
        auto_block = llm.stats()["kv_bytes_per_block_per_rank"]
    total = conversation_blocks(workload, block_size)
    kv_bytes = plan(workload, block_size, pool_share)["tier-off"]["num_kv_blocks"] * auto_block
    rounds: dict[str, list[dict]] = {fmt: [] for fmt in formats}
    for _ in range(repeat):
        for fmt in formats:
            run = run_config(model, workload, block_size, {"kv_cache_memory_bytes": kv_bytes}, kv_cache_dtype=fmt,
                             **engine_kwargs)
            del run["token_ids"]
            rounds[fmt].append(run)
    runs = best_rounds(rounds)
    for fmt in formats:
        runs[fmt]["tokens_per_s_vs_auto"] = runs[fmt]["output_tokens_per_s"] / runs["auto"]["output_tokens_per_s"]
    return {"workload": workload.description, "conversation_blocks": total, "pool_share_at_auto": pool_share,
            "kv_bytes": kv_bytes, "repeat": repeat, "runs": runs}


def bench_kv_quant(model: str, formats=FORMATS, block_size: int = 16, hf: bool = True, kv_gib: float = 1.0,
                   capacity_len: int = 2048, pool_share: float = 0.25, repeat: int = 2, users: int = 16,
                   turns: int = 4, output_len: int = 32, accuracy_requests: int = 16, parts=("accuracy", "capacity",
                                                                                          "speed"),
                   **engine_kwargs) -> dict:
    formats = ("auto", *[f for f in formats if f != "auto"])
    report: dict = {"model": model, "formats": list(formats), "block_size": block_size, "engine": engine_kwargs}
    workloads = {  # the accuracy and sources parts' prompts
        "shared-system-prompt": shared_system_prompt(model, num_requests=accuracy_requests, output_len=output_len),
        "multi-turn": multi_turn(model, num_users=max(1, accuracy_requests // turns), num_turns=turns,
                                 output_len=output_len),
    } if {"accuracy", "sources"} & set(parts) else {}
    if "accuracy" in parts:
        report["accuracy"] = {name: accuracy(model, w, formats, block_size, hf, **engine_kwargs)
                              for name, w in workloads.items()}
    if "sources" in parts:
        from benchmarks.kv_quant_sources import error_sources, load_model

        hf_model = load_model(model)
        quantized = [f for f in formats if f != "auto"]
        report["sources"] = {name: error_sources(hf_model, w.prompts, w.output_len, quantized)
                             for name, w in workloads.items()}
    if "capacity" in parts:
        report["capacity"] = {"kv_bytes": int(kv_gib * 2**30), "seq_len": capacity_len,
                              "formats": capacity(model, formats, block_size, int(kv_gib * 2**30), capacity_len,
                                                  **engine_kwargs)}
    if "speed" in parts:
        report["speed"] = speed(model, formats, block_size, pool_share, repeat, users, turns, output_len,
                                **engine_kwargs)
    return report


def format_kv_quant_report(report: dict) -> str:
    lines = [f"model {report['model']}, block size {report['block_size']}"]
    for name, acc in report.get("accuracy", {}).items():
        lines += ["", f"accuracy, {name}: {acc['sequences']} sequences, {acc['scored_positions']} positions scored, "
                  f"{acc['generated_positions']} generated", "",
                  "| format | |Δ logprob| vs auto mean / p99 / max | vs HF mean / p99 / max | greedy agreement | "
                  + " | ".join(f"where auto's top-2 gap >= {m} ({acc['formats']['auto']['generated_positions_by_margin'][str(m)]})"
                               for m in MARGINS[1:]) + " |",
                  "|---|---|---|---:|" + "---:|" * (len(MARGINS) - 1)]
        for fmt, e in acc["formats"].items():
            a, h = e["delta_logprob_vs_auto"], e.get("delta_logprob_vs_hf")
            hf = f"{h['mean']:.5f} / {h['p99']:.5f} / {h['max']:.5f}" if h else "-"
            by = e["greedy_agreement_by_margin"]
            lines.append(f"| {fmt} | {a['mean']:.5f} / {a['p99']:.5f} / {a['max']:.5f} | {hf} | "
                         f"{100 * e['greedy_agreement']:.2f}% | "
                         + " | ".join("-" if by[str(m)] is None else f"{100 * by[str(m)]:.2f}%" for m in MARGINS[1:])
                         + " |")
    if "sources" in report:
        from benchmarks.kv_quant_sources import format_sources

        for name, src in report["sources"].items():
            lines += format_sources(name, src)
    if "capacity" in report:
        cap = report["capacity"]
        lines += ["", f"capacity in {cap['kv_bytes'] / 2**30:.2f} GiB of KV ({cap['seq_len']}-token sequences)", "",
                  "| format | bytes per block | blocks | x auto | sequences at once |", "|---|---:|---:|---:|---:|"]
        for fmt, c in cap["formats"].items():
            lines.append(f"| {fmt} | {c['kv_bytes_per_block']} | {c['num_kv_blocks']} | {c['blocks_vs_auto']:.2f} | "
                         f"{c['most_sequences']} |")
    if "speed" in report:
        sp = report["speed"]
        lines += ["", f"speed: {sp['workload']}; {sp['conversation_blocks']} blocks of conversation KV, pools of "
                  f"{sp['kv_bytes'] / 2**20:.1f} MiB (auto holds {sp['pool_share_at_auto']:.2f}); best of "
                  f"{sp['repeat']} rounds", "",
                  "| format | pool blocks | prefix hit rate | output tok/s | x auto | preemptions | every round |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for fmt, r in sp["runs"].items():
            lines.append(f"| {fmt} | {r['pool_blocks']} | {r['prefix_cache_hit_rate']:.3f} | "
                         f"{r['output_tokens_per_s']:.1f} | {r['tokens_per_s_vs_auto']:.2f} | {r['num_preemptions']} | "
                         + " / ".join(f"{x:.1f}" for x in r["rounds_output_tokens_per_s"]) + " |")
    return "\n".join(lines)


def add_bench_kv_quant_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory or Hugging Face repo id (default: the llama `small` preset)")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--parts", nargs="+", choices=("accuracy", "sources", "capacity", "speed"),
                        default=["accuracy", "capacity", "speed"],
                        help="sources (not run unless named): the error of rounding keys only, values only, "
                             "or keys turned by a Hadamard matrix, in transformers' own model")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers oracle")
    parser.add_argument("--accuracy-requests", type=int, default=16, help="prompts of each accuracy workload")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--kv-gib", type=float, default=1.0, help="capacity: KV bytes of every format's pool")
    parser.add_argument("--capacity-len", type=int, default=2048)
    parser.add_argument("--pool-share", type=float, default=0.25, help="speed: share of the KV auto's pool holds")
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="the model's dtype (auto: the engine's choice for the device)")
    parser.add_argument("--json", help="also write the report to this file")


def run_bench_kv_quant(args: argparse.Namespace) -> int:
    from workers.model_source import resolve_model

    model = str(resolve_model(args.model))
    report = bench_kv_quant(model, formats=args.formats, block_size=args.block_size, hf=not args.no_hf,
                            kv_gib=args.kv_gib, capacity_len=args.capacity_len, pool_share=args.pool_share,
                            repeat=args.repeat, users=args.users, turns=args.turns, output_len=args.output_len,
                            accuracy_requests=args.accuracy_requests, parts=args.parts,
                            attention_backend=args.attention_backend, dtype=args.dtype)
    print(format_kv_quant_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
