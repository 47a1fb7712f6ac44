"""One placement group per engine instance, one bundle per rank (a pipeline stage's ranks on one node where
the bundles allow)."""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group


class PlacementError(RuntimeError):
    """The cluster cannot hold the worker group; the message says what was asked and what exists."""


def bundle_for(use_gpu: bool, num_cpus_per_rank: float = 1.0, memory: int = 0) -> dict[str, float]:
    """One rank's bundle; ``memory``: the bytes of host memory it holds (``cluster.memory_plan``), 0 to
    reserve none."""
    bundle = {"GPU": 1.0, "CPU": num_cpus_per_rank} if use_gpu else {"CPU": num_cpus_per_rank}
    if memory > 0:
        bundle["memory"] = float(memory)
    return bundle


def _amount(key: str, value: float) -> str:
    return f"{value / 2**30:.2f} GiB" if "memory" in key else f"{value:g}"


def _show(resources: dict[str, float]) -> str:
    return ", ".join(f"{k} {_amount(k, v)}" for k, v in resources.items() if not k.startswith("node:"))


def _packs(bundles: list[dict[str, float]], nodes: list[dict[str, float]], budget: int = 100_000) -> bool:
    """Whether every bundle can go on some node without a node's totals overflowing (a search over the
    assignments, largest bundles first; True where the search runs out of ``budget`` steps)."""
    keys = sorted({k for b in bundles for k in b})
    order = sorted(bundles, key=lambda b: tuple(-b.get(k, 0.0) for k in keys))
    left = [{k: n.get(k, 0.0) for k in keys} for n in nodes]
    steps = 0

    def place(i: int) -> bool:
        nonlocal steps
        if i == len(order):
            return True
        seen = set()
        for node in left:
            state = tuple(node[k] for k in keys)
            if state in seen or any(order[i].get(k, 0.0) > node[k] + 1e-9 for k in keys):
                continue
            seen.add(state)
            steps += 1
            if steps > budget:
                return True
            for k in keys:
                node[k] -= order[i].get(k, 0.0)
            done = place(i + 1)
            for k in keys:
                node[k] += order[i].get(k, 0.0)
            if done:
                return True
        return False

    return place(0)


def _fits(bundles: list[dict[str, float]], strategy: str) -> str | None:
    """Why ``bundles`` cannot be placed with ``strategy`` on the live nodes, or None if they can."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    if not nodes:
        return "the Ray cluster has no live nodes"
    keys = list(dict.fromkeys(k for b in bundles for k in b))
    total = {k: sum(n.get(k, 0) for n in nodes) for k in keys}
    need = {k: sum(b.get(k, 0.0) for b in bundles) for k in keys}
    short = [f"{k}: need {_amount(k, need[k])}, cluster has {_amount(k, total[k])}" for k in keys if need[k] > total[k]]
    if short:
        return "; ".join(short)
    if strategy == "STRICT_PACK" and not any(all(n.get(k, 0) >= need[k] for k in keys) for n in nodes):
        biggest = max(nodes, key=lambda n: n.get("CPU", 0))
        return (f"STRICT_PACK needs one node with {_show(need)}, the largest has "
                f"{_show({k: biggest.get(k, 0) for k in keys})} (use placement_strategy PACK or SPREAD for multi-node)")
    if strategy == "STRICT_SPREAD" and len(nodes) < len(bundles):
        return f"STRICT_SPREAD needs {len(bundles)} nodes, the cluster has {len(nodes)}"
    if strategy in ("PACK", "SPREAD") and not _packs(bundles, nodes):
        return (f"no assignment of the bundles to nodes fits (nodes: "
                f"{'; '.join(_show({k: n.get(k, 0) for k in keys}) for n in nodes)})")
    return None


def create_placement_group(
    num_ranks: int, use_gpu: bool, strategy: str = "STRICT_PACK", timeout_s: float = 60.0,
    num_cpus_per_rank: float = 1.0, memory_per_rank: int = 0,
) -> PlacementGroup:
    """Reserve one bundle per rank; raise PlacementError, never hang, when it cannot be placed."""
    bundles = [bundle_for(use_gpu, num_cpus_per_rank, memory_per_rank) for _ in range(num_ranks)]
    reason = _fits(bundles, strategy)
    if reason is not None:
        raise PlacementError(f"cannot place {num_ranks} x {{{_show(bundles[0])}}} with {strategy}: {reason}")
    group = placement_group(bundles, strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise PlacementError(
            f"{num_ranks} x {{{_show(bundles[0])}}} with {strategy} was not placed within {timeout_s:g}s; "
            f"available now: {_show(ray.available_resources())}"
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
