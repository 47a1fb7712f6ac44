"""The benchmark report: one Markdown summary of every workload's runs, the JSON it was made from and
the plots, written together into one folder. Any optional field of a run may be missing or None; it
shows as "-"."""

from __future__ import annotations

import json
import os

from benchmarks.plots import CACHE_RUN, plot_report
from benchmarks.targets import vllm_ratios

DASH = "-"
COLUMNS = ("run", "mode", "conc/rate", "out tok/s", "req/s", "TTFT p50/p90/p99 (ms)", "ITL p50/p99 (ms)",
           "E2E p50/p99 (s)", "hit rate", "KV peak", "KV waste", "preempt")


def _fixed(value, digits: int) -> str:
    return DASH if value is None else f"{value:.{digits}f}"


def _percent(fraction) -> str:
    return DASH if fraction is None else f"{100 * fraction:.1f}%"


def _ms(seconds) -> str:
    """Milliseconds: one decimal below 10 ms, whole above."""
    if seconds is None:
        return DASH
    ms = 1000 * seconds
    return f"{ms:.1f}" if ms < 10 else f"{ms:.0f}"


def _quantiles(dist: dict | None, keys: tuple[str, ...], fmt) -> str:
    if not dist or not dist.get("count"):
        return DASH
    return " / ".join(fmt(dist.get(k)) for k in keys)


def _number(value) -> str:
    """A measured or required value of a target: ints as they are, floats to a sensible precision."""
    if value is None:
        return DASH
    if isinstance(value, bool) or isinstance(value, int):
        return str(value)
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.3f}"


def _load(run: dict) -> str:
    if run.get("request_rate") is not None:
        return f"{run['request_rate']:g} req/s"
    if run.get("concurrency") is not None:
        return f"c={run['concurrency']}"
    return DASH


def _row(run: dict, mode: str) -> str:
    name = run["name"] + (f" ({run['num_failed']} failed)" if run.get("num_failed") else "")
    preemptions = run.get("num_preemptions")
    cells = (name, run.get("mode") or mode, _load(run), _fixed(run.get("output_tokens_per_s"), 1),
             _fixed(run.get("requests_per_s"), 3), _quantiles(run.get("ttft_s"), ("p50", "p90", "p99"), _ms),
             _quantiles(run.get("itl_s"), ("p50", "p99"), _ms),
             _quantiles(run.get("e2e_s"), ("p50", "p99"), lambda s: _fixed(s, 2)),
             _percent(run.get("prefix_cache_hit_rate")), _percent(run.get("kv_cache_usage_peak")),
             _percent(run.get("kv_waste_at_peak")), DASH if preemptions is None else str(preemptions))
    return "| " + " | ".join(cells) + " |"


def _speedups(runs: list[dict]) -> list[str]:
    """The cache run's output throughput over each other offline run's."""
    cache = next((r for r in runs if r["name"] == CACHE_RUN), None)
    if cache is None or not cache.get("output_tokens_per_s"):
        return []
    return [f"- {CACHE_RUN} vs {r['name']}: {cache['output_tokens_per_s'] / r['output_tokens_per_s']:.2f}x"
            for r in runs if r is not cache and r.get("output_tokens_per_s")]


def _ratio(value) -> str:
    return DASH if value is None else f"{value:.2f}x"


def _instances(runs: list[dict]) -> list[str]:
    """First against steady instance of each offline run that has both (fresh-process runs)."""
    runs = [r for r in runs if r.get("first")]
    if not runs:
        return []
    rounds = any(r.get("rounds") for r in runs)
    lines = ["First instance (right after the system was built, no warm-up) and steady instance (the same "
             "shape, other tokens, next in the same process)"
             + (", the best of the rounds, every round's first / steady tok/s beside it:" if rounds else ":"), "",
             "| run | start s | first tok/s | steady tok/s | steady/first | TTFT p50 first / steady (ms) "
             "| same tokens as kvserve-cache first / steady |" + (" rounds (first / steady) |" if rounds else ""),
             "|---|---:|---:|---:|---:|---:|---:|" + ("---|" if rounds else "")]
    for run in runs:
        first = run["first"]
        same = [part.get("same_tokens_as_kvserve_cache") for part in (first, run)]
        row = (f"| {run['name']} | {_fixed(run.get('start_s'), 1)} "
               f"| {_fixed(first.get('output_tokens_per_s'), 1)} "
               f"| {_fixed(run.get('output_tokens_per_s'), 1)} | {_fixed(run.get('steady_over_first'), 2)} "
               f"| {_ms((first.get('ttft_s') or {}).get('p50'))} / {_ms((run.get('ttft_s') or {}).get('p50'))} "
               f"| {' / '.join(_percent(v) for v in same) if any(v is not None for v in same) else DASH} |")
        if rounds:
            row += " " + ", ".join(f"{_fixed(r['first'], 0)} / {_fixed(r['steady'], 0)}"
                                   for r in run.get("rounds") or []) + " |"
        lines.append(row)
    return lines + [""]


def _vllm(section: dict) -> list[str]:
    rows = vllm_ratios(section)
    if not rows:
        return []
    lines = ["kvserve beside vLLM (output tok/s, kvserve / vLLM):", "",
             "| kvserve | vLLM | instance | kvserve tok/s | vLLM tok/s | kvserve/vLLM | TTFT p50 kvserve / vLLM (ms) |",
             "|---|---|---|---:|---:|---:|---:|"]
    for row in rows:
        for label in ("first", "steady"):
            cell = row.get(label)
            if cell:
                lines.append(f"| {row['kvserve']} | {row['vllm']} | {label} | {_fixed(cell['kvserve_tok_s'], 1)} "
                             f"| {_fixed(cell['vllm_tok_s'], 1)} | {_ratio(cell['ratio'])} "
                             f"| {_ms(cell['kvserve_ttft_p50_s'])} / {_ms(cell['vllm_ttft_p50_s'])} |")
    vllm = [r for r in section.get("runs") or [] if r["name"].startswith("vllm-")]
    starts = ", ".join(f"{r['name']} {_fixed(r.get('start_s'), 1)} s" for r in vllm)
    threads = ", ".join(sorted({str((r.get("process") or {}).get("torch_threads")) for r in vllm}))
    lines += ["", f"vLLM start (LLM constructed, after import): {starts}; its torch threads: {threads}."]
    return lines + [""]


def _targets(targets: list[dict]) -> list[str]:
    lines = ["| target | measured | required | met |", "|---|---:|---:|:---:|"]
    for t in targets:
        met = DASH if t.get("met") is None else ("✅" if t["met"] else "❌")
        lines.append(f"| {t['name']} | {_number(t.get('value'))} | {_number(t.get('target'))} | {met} |")
    return lines


def _workload(name: str, section: dict) -> list[str]:
    lines = [f"### {name}", ""]
    if section.get("description"):
        lines += [section["description"], ""]
    offline, online = section.get("runs") or [], section.get("online") or []
    if offline or online:
        lines += ["| " + " | ".join(COLUMNS) + " |", "|---|---|---|" + "---:|" * (len(COLUMNS) - 3)]
        lines += [_row(run, "offline") for run in offline] + [_row(run, "online") for run in online]
        lines.append("")
    lines += _instances(offline) + _vllm(section)
    speedups = _speedups(offline)
    if speedups:
        lines += ["Output throughput speedups (offline):", *speedups, ""]
    if section.get("targets"):
        lines += _targets(section["targets"]) + [""]
    for failure in section.get("failed") or []:
        last = [line for line in failure["error"].splitlines() if line.strip()][-1:] or [""]
        lines += [f"**{failure['system']} failed**: {last[0]}", ""]
    return lines


def format_markdown(report: dict) -> str:
    machine = report.get("machine") or {}
    model = f"`{report['model']}`" if report.get("model") else DASH
    if report.get("model_params") is not None:
        model += f" ({report['model_params'] / 1e6:.1f}M parameters)"
    lines = ["## kvserve benchmark report", "", f"Command: `{report.get('command', DASH)}`", "",
             f"Machine: {machine.get('platform', DASH)}, {machine.get('cpus', DASH)} CPUs, "
             f"{machine.get('torch_threads', DASH)} torch threads, torch {machine.get('torch', DASH)}, "
             f"Python {machine.get('python', DASH)}", "", f"Model: {model}", ""]
    settings = report.get("settings")
    if settings:
        lines += [f"Settings: {settings.get('threads', DASH)} threads (OMP_NUM_THREADS and torch), kvserve block size "
                  f"{(report.get('kvserve') or {}).get('block_size', DASH)}, max_num_seqs "
                  f"{settings.get('max_num_seqs', DASH)}, max_num_batched_tokens "
                  f"{settings.get('max_num_batched_tokens', DASH)}, KV cache "
                  f"{_fixed((settings.get('kv_cache_memory_bytes') or 0) / 2**30, 1)} GiB"
                  + (f" in {settings['kv_cache_dtype']}" if settings.get("kv_cache_dtype", "auto") != "auto" else "")
                  + (f"; kvserve's cpu_matmul_precision {settings['cpu_matmul_precision']}"
                     if settings.get("cpu_matmul_precision", "highest") != "highest" else "")
                  + "; "
                  f"{settings.get('process', '')}"
                  + (f"; {settings['repeat']} rounds, the systems taking turns, each system's best round"
                     if (settings.get("repeat") or 1) > 1 else "")
                  + ". Tables show the steady instance unless they say otherwise.", ""]
    vllm = report.get("vllm")
    if vllm:
        threads = vllm.get("threads")
        threads = "OMP_NUM_THREADS unset (vLLM's own thread choice)" if threads == 0 else f"OMP_NUM_THREADS={threads}"
        lines += [f"vLLM {vllm.get('version') or DASH} (`{vllm.get('python', DASH)}`): {threads}, block size {vllm.get('block_size', DASH)}, float32, greedy, "
                  f"EOS ignored, the same max_num_seqs, max_num_batched_tokens, max_model_len and KV bytes.", ""]
    for name, section in (report.get("workloads") or {}).items():
        lines += _workload(name, section)
    overhead = report.get("overhead")
    if overhead:
        lines.append(f"Engine step overhead at {overhead.get('num_running', DASH)} running sequences: "
                     f"{_percent(overhead.get('overhead_fraction'))} (step {_fixed(overhead.get('step_ms'), 1)} ms, "
                     f"forward {_fixed(overhead.get('forward_ms'), 1)} ms)")
    return "\n".join(lines).rstrip() + "\n"


def format_console(report: dict) -> str:
    """What `kvserve bench` prints: the Markdown, whose pipe tables read well in a terminal."""
    return format_markdown(report)


def write_report(report: dict, out_dir: str) -> dict[str, str | list[str]]:
    """report.json, report.md and the PNG plots in out_dir (created if missing); their paths."""
    os.makedirs(out_dir, exist_ok=True)
    json_path, md_path = os.path.join(out_dir, "report.json"), os.path.join(out_dir, "report.md")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2)
    with open(md_path, "w") as f:
        f.write(format_markdown(report))
    return {"json": json_path, "markdown": md_path, "plots": plot_report(report, out_dir)}
