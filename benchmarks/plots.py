"""PNG plots of a benchmark report (the dict benchmarks.report renders). matplotlib is imported only
when plotting, so running and reporting benchmarks works without it. Each plot is left out when the
report holds no data for it."""

from __future__ import annotations

import math
import os

CACHE_RUN = "kvserve-cache"  # the run the others are measured against
DPI = 110


def _figure(nrows: int = 1, ncols: int = 1, *, size: tuple[float, float], **kwargs):
    """A figure on the Agg canvas (no pyplot, no global state) and its axes as a 2-D array."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="tight")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=False, **kwargs)


def _runs(section: dict):
    """(mode, run) for a workload's offline runs, then its online ones."""
    for mode, key in (("offline", "runs"), ("online", "online")):
        for run in section.get(key) or []:
            yield run.get("mode") or mode, run


def _throughput_bars(report: dict):
    """Offline output tok/s, one group of bars per workload, one bar per system."""
    workloads = [(name, {r["name"]: r["output_tokens_per_s"] for r in section.get("runs") or []
                         if r.get("output_tokens_per_s") is not None})
                 for name, section in (report.get("workloads") or {}).items()]
    workloads = [(name, runs) for name, runs in workloads if runs]
    if not workloads:
        return None
    systems = dict.fromkeys(system for _, runs in workloads for system in runs)  # in order of appearance
    colours = {system: f"C{i % 10}" for i, system in enumerate(systems)}
    width = 0.8 / max(len(runs) for _, runs in workloads)
    labelled = set()
    fig, axes = _figure(size=(max(6.5, 1.5 + 0.6 * sum(len(runs) for _, runs in workloads)), 4.5))
    ax = axes[0][0]
    label_fmt = "%.0f" if max(v for _, runs in workloads for v in runs.values()) >= 100 else "%.1f"
    for w, (_, runs) in enumerate(workloads):
        for j, (system, value) in enumerate(runs.items()):
            bars = ax.bar(w + (j - (len(runs) - 1) / 2) * width, value, width, color=colours[system],
                          label=None if system in labelled else system)
            ax.bar_label(bars, fmt=label_fmt, fontsize=8)
            labelled.add(system)
    ax.set_xticks(range(len(workloads)), [name for name, _ in workloads])
    ax.set_ylim(0, ax.get_ylim()[1] * 1.08)  # room for the bar labels
    ax.set_ylabel("output throughput (tokens/s)")
    ax.set_title("Offline output throughput per system")
    ax.legend(fontsize="small")
    return fig


def _throughput_vs_concurrency(report: dict):
    """Online output tok/s against client concurrency, one line per workload, with its offline
    kvserve-cache throughput as a dashed line of the same colour."""
    series = []
    for name, section in (report.get("workloads") or {}).items():
        points = sorted((r["concurrency"], r["output_tokens_per_s"]) for r in section.get("online") or []
                        if r.get("concurrency") is not None and r.get("output_tokens_per_s") is not None)
        if points:
            cache = next((r for r in section.get("runs") or [] if r["name"] == CACHE_RUN), None)
            series.append((name, points, cache and cache.get("output_tokens_per_s")))
    if not series:
        return None
    fig, axes = _figure(size=(7.5, 4.5))
    ax = axes[0][0]
    for i, (name, points, offline) in enumerate(series):
        ax.plot(*zip(*points), marker="o", color=f"C{i % 10}", label=f"{name} (online)")
        if offline is not None:
            ax.axhline(offline, linestyle="--", color=f"C{i % 10}", label=f"{name}: offline {CACHE_RUN}")
    ticks = sorted({c for _, points, _ in series for c, _ in points})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(c) for c in ticks])
    ax.minorticks_off()
    ax.set_ylim(0, ax.get_ylim()[1] * 1.08)  # keeps the offline line off the frame
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output throughput (tokens/s)")
    ax.set_title("Online throughput against concurrency")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def _ttft_distribution(report: dict):
    """Empirical CDF of time to first token for every run, one panel per workload."""
    from matplotlib.ticker import FuncFormatter, LogFormatter

    panels = []
    for name, section in (report.get("workloads") or {}).items():
        series = [(run["name"], mode, sorted(1000 * s for s in run.get("ttft_samples_s") or [] if s > 0))
                  for mode, run in _runs(section)]
        series = [s for s in series if s[2]]
        if series:
            panels.append((name, series))
    if not panels:
        return None
    ncols = min(2, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = _figure(nrows, ncols, size=(6.5 * ncols, 4.3 * nrows))
    for ax, (name, series) in zip(axes.flat, panels):
        for i, (run, mode, ms) in enumerate(series):
            fractions = [0.0] + [(k + 1) / len(ms) for k in range(len(ms))]
            ax.step([ms[0]] + ms, fractions, where="post", label=f"{run} ({mode})", color=f"C{i % 10}",
                    linestyle="--" if mode == "online" else "-")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("time to first token (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"TTFT distribution: {name}")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="small")
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    return fig


def _hit_rate_over_time(report: dict):
    """Per workload (one column each): the cumulative prefix-cache hit rate (top) and the share of KV
    blocks in use (bottom) over each run's timeline."""
    from matplotlib.ticker import PercentFormatter

    columns = [(name, [(run["name"], run["timeline"]) for _, run in _runs(section) if run.get("timeline")])
               for name, section in (report.get("workloads") or {}).items()]
    columns = [(name, series) for name, series in columns if series]
    if not columns:
        return None
    fig, axes = _figure(2, len(columns), size=(4.2 * len(columns), 6.5))
    for col, (workload, series) in enumerate(columns):
        top, bottom = axes[0][col], axes[1][col]
        peak = 0.0
        for i, (label, timeline) in enumerate(series):
            points = [p for p in timeline if p.get("t") is not None]
            top.plot([p["t"] for p in points], [p.get("prefix_cache_hit_rate") or 0.0 for p in points],
                     color=f"C{i % 10}", label=label)
            usage = [p.get("kv_cache_usage") or 0.0 for p in points]
            bottom.plot([p["t"] for p in points], usage, color=f"C{i % 10}", label=label)
            peak = max([peak, *usage])
        top.set_ylim(0, 1.02)
        bottom.set_ylim(0, min(1.0, max(0.05, 1.2 * peak)))
        for ax in (top, bottom):
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
            ax.grid(alpha=0.3)
        top.set_title(f"{workload}: prefix-cache hit rate")
        bottom.set_title(f"{workload}: KV blocks in use")
        bottom.set_xlabel("time since run start (s)")
        top.legend(fontsize="x-small", loc="lower right")
    axes[0][0].set_ylabel("hit rate (cumulative)")
    axes[1][0].set_ylabel("share of KV blocks")
    return fig


PLOTS = (("throughput.png", _throughput_bars), ("throughput_vs_concurrency.png", _throughput_vs_concurrency),
         ("ttft_distribution.png", _ttft_distribution), ("hit_rate_over_time.png", _hit_rate_over_time))


def plot_report(report: dict, out_dir: str) -> list[str]:
    """Writes each plot the report has data for into out_dir; their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for file_name, plot in PLOTS:
        fig = plot(report)
        if fig is not None:
            path = os.path.join(out_dir, file_name)
            fig.savefig(path, dpi=DPI)
            paths.append(path)
    return paths
