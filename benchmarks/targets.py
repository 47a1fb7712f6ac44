"""The performance targets kvserve holds itself to, checked against a benchmark's measurements.

On the shared-system-prompt workload, kvserve with prefix caching must reuse the prompt (hit rate),
beat its own caching-off run and both Hugging Face peers by the given factors, and waste little of
the KV it allocates; at a full decode batch the engine's own work outside the model forward must
stay a small share of the step."""

from __future__ import annotations

SPEEDUPS = {"kvserve-nocache": 2.0, "hf-static": 3.0, "hf-continuous": 1.5}  # minimum cache / peer throughput
MIN_HIT_RATE = 0.75
MAX_KV_WASTE = 0.04
MAX_STEP_OVERHEAD = 0.10
TARGET_WORKLOAD = "shared-system-prompt"


def _target(name: str, value: float, target: float, at_least: bool) -> dict:
    return {"name": name, "value": value, "target": target, "at_least": at_least,
            "met": value >= target if at_least else value <= target}


def evaluate_targets(workload: str, section: dict, overhead: dict | None) -> list[dict]:
    """The targets that the offline runs of ``section`` measured: none for a workload other than
    the shared system prompt, or without a kvserve-cache run."""
    runs = {run["name"]: run for run in section.get("runs", ())}
    cache = runs.get("kvserve-cache")
    if workload != TARGET_WORKLOAD or cache is None:
        return []
    targets = [_target("prefix hit rate", cache["prefix_cache_hit_rate"], MIN_HIT_RATE, True),
               _target("KV waste at peak", cache["kv_waste_at_peak"], MAX_KV_WASTE, False)]
    for peer, factor in SPEEDUPS.items():
        match = next((r for n, r in runs.items() if n == peer or n.startswith(peer + "-")), None)
        if match is not None and match["output_tokens_per_s"] > 0:
            targets.append(_target(f"throughput vs {match['name']} (x)",
                                   cache["output_tokens_per_s"] / match["output_tokens_per_s"], factor, True))
    if overhead is not None:
        targets.append(_target(f"step overhead at {overhead['num_running']} running",
                               overhead["overhead_fraction"], MAX_STEP_OVERHEAD, False))
    return targets
