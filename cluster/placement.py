"""One placement group per engine instance, one bundle per rank (a pipeline stage's ranks on one node where
the bundles allow)."""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group


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


def stage_bundles(bundle_nodes: list[str], tp: int, pp: int) -> list[int]:
    """The bundle (an index into ``bundle_nodes``, each bundle's node) of each rank, in rank order, so
    that a pipeline stage's ``tp`` ranks share a node: each stage in turn takes ``tp`` bundles of the
    first node (in bundle order) that has that many left, else the lowest ones left (the stage then
    spans nodes: its all-reduces cross the network, nothing else changes)."""
    free: dict[str, list[int]] = {}
    for index, node in enumerate(bundle_nodes[:tp * pp]):
        free.setdefault(node, []).append(index)
    order: list[int] = []
    for _ in range(pp):
        node = next((n for n, left in free.items() if len(left) >= tp), None)
        if node is not None:
            taken, free[node] = free[node][:tp], free[node][tp:]
        else:
            taken = sorted(i for left in free.values() for i in left)[:tp]
            for n in free:
                free[n] = [i for i in free[n] if i not in taken]
        order += taken
    return order


def rank_bundles(placement_group, first_bundle: int, tp: int, pp: int) -> list[int]:
    """The bundles of a placed group that ranks 0 .. tp * pp - 1 take (``stage_bundles``); in order
    at one stage or one rank per stage, where any order is as good."""
    if pp == 1 or tp == 1:
        return [first_bundle + r for r in range(tp * pp)]
    nodes = placement_group_table(placement_group)["bundles_to_node_id"]
    return [first_bundle + i for i in stage_bundles([nodes[first_bundle + i] for i in range(tp * pp)], tp, pp)]
