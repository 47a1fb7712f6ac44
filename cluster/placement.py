"""One placement group per engine instance, one bundle per tensor-parallel rank."""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group


class PlacementError(RuntimeError):
    """The cluster cannot hold the worker group; the message says what was asked and what exists."""


def bundle_for(use_gpu: bool, num_cpus_per_rank: float = 1.0) -> dict[str, float]:
    return {"GPU": 1.0, "CPU": num_cpus_per_rank} if use_gpu else {"CPU": num_cpus_per_rank}


def _fits(bundles: list[dict[str, float]], strategy: str) -> str | None:
    """Why ``bundles`` cannot be placed with ``strategy`` on the live nodes, or None if they can."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    if not nodes:
        return "the Ray cluster has no live nodes"
    total = {k: sum(n.get(k, 0) for n in nodes) for k in bundles[0]}
    need = {k: sum(b[k] for b in bundles) for k in bundles[0]}
    short = [f"{k}: need {need[k]:g}, cluster has {total[k]:g}" for k in need if need[k] > total[k]]
    if short:
        return "; ".join(short)
    if strategy == "STRICT_PACK" and not any(all(n.get(k, 0) >= need[k] for k in need) for n in nodes):
        biggest = max(nodes, key=lambda n: n.get("CPU", 0))
        return (f"STRICT_PACK needs one node with {need}, the largest has "
                f"{ {k: biggest.get(k, 0) for k in need} } (use placement_strategy PACK or SPREAD for multi-node)")
    if strategy == "STRICT_SPREAD" and len(nodes) < len(bundles):
        return f"STRICT_SPREAD needs {len(bundles)} nodes, the cluster has {len(nodes)}"
    return None


def create_placement_group(
    num_ranks: int, use_gpu: bool, strategy: str = "STRICT_PACK", timeout_s: float = 60.0,
    num_cpus_per_rank: float = 1.0,
) -> PlacementGroup:
    """Reserve one bundle per rank; raise PlacementError, never hang, when it cannot be placed."""
    bundles = [bundle_for(use_gpu, num_cpus_per_rank) for _ in range(num_ranks)]
    reason = _fits(bundles, strategy)
    if reason is not None:
        raise PlacementError(f"cannot place {num_ranks} x {bundles[0]} with {strategy}: {reason}")
    group = placement_group(bundles, strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise PlacementError(
            f"{num_ranks} x {bundles[0]} with {strategy} was not placed within {timeout_s:g}s; "
            f"available now: {ray.available_resources()}"
        )
    return group
