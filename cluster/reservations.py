"""What each LLMServer replica reserves (its placement group's bundles) and where its actors go,
sized for the cluster the application will run on."""

from __future__ import annotations

import math
from dataclasses import dataclass

import ray

from cluster.app_args import AppArgs

DEFAULT_PROXY_CPUS = 0.5


@dataclass(frozen=True)
class Reservations:
    """What one LLMServer replica reserves (its placement group) and where each actor goes in it."""

    bundles: list[dict[str, float]]
    replica_cpus: float  # the LLMServer replica actor, in bundle 0
    engine_bundle: int  # the scheduler actor's bundle
    engine_cpus: float  # the scheduler actor's CPUs (it runs the model at tp = 1)
    first_rank_bundle: int  # rank r takes bundle first_rank_bundle + r (tp > 1)
    ingress_cpus: float
    rank_cpus: float = 1.0  # the engine's (tp = 1) or each rank's compute CPUs: engine_cpus, given or chosen
    # what the engine and the serving actors beside it reserve on its node (the engine's default threads
    # are its share of the node's cores: cluster/cpu_plan.py); None on a GPU
    cpu_share: float | None = None


def default_engine_cpus(args: AppArgs, use_gpu: bool, cpus: tuple[float, float] | None) -> float:
    """``engine_cpus`` when not given: 1 on a GPU, an unknown cluster or at tensor_parallel_size > 1;
    on CPU nodes at tp = 1 each engine takes what its node leaves after the serving actors'
    reservations (the replica and the Ingress, ``proxy_cpus`` each), the node shared by as many
    engines as the replicas (their most, autoscaling) need per node, and never less than 1."""
    if args.engine_cpus is not None:
        return args.engine_cpus
    if use_gpu or cpus is None or args.tensor_parallel_size * args.pipeline_parallel_size > 1:  # (a rank actor runs
        # on the one CPU it is made with)
        return 1.0
    node, total = cpus
    high = args.replica_range[1]
    nodes = max(1, round(total / node)) if node > 0 else 1
    engines_per_node = max(1, math.ceil(high / nodes))
    proxy = DEFAULT_PROXY_CPUS if args.proxy_cpus is None else args.proxy_cpus
    serving = proxy * 2  # the replica's and the Ingress's
    per_engine = math.floor(node / engines_per_node - serving)
    if high * per_engine > total:
        per_engine = math.floor(total / high)
    return float(max(1, per_engine))


def cluster_cpus() -> tuple[float, float] | None:
    """(CPUs of the largest node, CPUs of the cluster) where the application will run, or None when
    that cannot be known here. `serve run serve_app:app` builds the app before it starts or joins Ray:
    without RAY_ADDRESS and without a cluster from `ray start` on this machine it starts a local one,
    with the CPUs Ray detects here."""
    try:
        if ray.is_initialized():
            cpus = [n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")]
            return (max(cpus), sum(cpus)) if cpus else None
        from ray._private.services import canonicalize_bootstrap_address
        from ray._private.utils import get_num_cpus

        if canonicalize_bootstrap_address(None) is None:
            local = float(get_num_cpus())
            return local, local
    except Exception:  # noqa: BLE001 - an unknown cluster: the default reservations, unchecked
        pass
    return None


def cluster_memory() -> list[float] | None:
    """Each live node's ``memory`` resource (bytes) where the application will run, or None when that
    cannot be known here. Before a local cluster starts: Ray's own default for this machine, as Ray
    computes it (the memory available, cgroup limits included, less the object store's default share
    of it)."""
    try:
        if ray.is_initialized():
            return [n["Resources"].get("memory", 0.0) for n in ray.nodes() if n.get("Alive")] or None
        from ray._private.services import canonicalize_bootstrap_address
        from ray._private.utils import estimate_available_memory, resolve_object_store_memory

        if canonicalize_bootstrap_address(None) is None:
            available = estimate_available_memory()
            return [float(max(0, available - resolve_object_store_memory(available)))]
    except Exception:  # noqa: BLE001 - an unknown cluster: nothing is checked
        pass
    return None


def plan_reservations(args: AppArgs, use_gpu: bool, cpus: tuple[float, float] | None,
                      rank_memory: int = 0) -> Reservations:
    """Each replica's bundles: [replica] + [engine (the model at tp = 1)] or [replica, scheduler] +
    [rank] * tp * pp. The engine (or each rank) takes ``engine_cpus``; the replica, the scheduler actor at
    tp > 1 and the Ingress take ``proxy_cpus``, by default 0.5 or what the cluster leaves over (0
    where it leaves nothing: they then share bundle 0, the engine's or rank 0's). ``cpus`` is (largest
    node, cluster) or None (unknown: nothing is checked). Raises ValueError, naming the setting to
    change, when the reservations cannot fit: a placement group that can never be placed would leave
    every request waiting. ``rank_memory``: the bytes of host memory each rank (or the engine at tp = 1)
    reserves (``cluster.memory_plan.bundle_memory``; 0: none)."""
    tp = args.tensor_parallel_size * args.pipeline_parallel_size  # the ranks (one engine at 1)
    high = args.replica_range[1]
    engine_cpus = default_engine_cpus(args, use_gpu, cpus)
    compute = engine_cpus * tp  # the engine at tp = 1, the ranks above
    shared = 1 if tp == 1 else 2  # CPU-less actors beside the compute: the replica (+ the scheduler)
    proxy = args.proxy_cpus
    if cpus is not None:
        node, total = cpus
        per_group = node if args.placement_strategy == "STRICT_PACK" else total
        where = "the largest node" if per_group == node else "the cluster"
        if compute > per_group:
            ranks = (f"tensor_parallel_size={args.tensor_parallel_size}" if args.pipeline_parallel_size == 1 else
                     f"{tp} ranks (tensor_parallel_size={args.tensor_parallel_size} x "
                     f"pipeline_parallel_size={args.pipeline_parallel_size})")
            setting = f"{ranks} with engine_cpus={engine_cpus:g} per rank" if tp > 1 else f"engine_cpus={engine_cpus:g}"
            lower = "tensor_parallel_size, pipeline_parallel_size (or engine_cpus)" if tp > 1 else "engine_cpus"
            raise ValueError(f"{setting} needs {compute:g} CPUs for one engine but {where} has {per_group:g}: "
                             f"lower {lower}, or run on a bigger node or cluster")
        if compute * high > total:
            raise ValueError(f"{high} replicas need {compute * high:g} CPUs for their engines but the cluster has "
                             f"{total:g}: lower num_replicas / max_replicas (or engine_cpus, tensor_parallel_size)")
        if proxy is None:
            room = min((per_group - compute) / shared, (total - compute * high) / (shared * high + 1))
            proxy = min(DEFAULT_PROXY_CPUS, math.floor(max(room, 0.0) * 100) / 100)
        elif compute + shared * proxy > per_group or (compute + shared * proxy) * high + proxy > total:
            raise ValueError(f"proxy_cpus={proxy:g} leaves too few CPUs for the engines ({total:g} in the cluster, "
                             f"{per_group:g} for one replica): lower proxy_cpus (0 is allowed)")
    elif proxy is None:
        proxy = DEFAULT_PROXY_CPUS
    gpu = {"GPU": 1.0} if use_gpu else {}
    if use_gpu and args.accelerator_type is not None:  # Ray's node label resource for that GPU model
        gpu[f"accelerator_type:{args.accelerator_type}"] = 0.001
    memory = {"memory": float(rank_memory)} if rank_memory > 0 else {}
    engine = [{"CPU": engine_cpus, **gpu, **memory}] * tp
    share = None if use_gpu else engine_cpus * tp + proxy * (shared + 1)
    if proxy > 0:
        aux = [{"CPU": proxy}] * shared
        return Reservations(aux + engine, replica_cpus=proxy, engine_bundle=1,
                            engine_cpus=engine_cpus if tp == 1 else proxy, first_rank_bundle=shared,
                            ingress_cpus=proxy, rank_cpus=engine_cpus, cpu_share=share)
    return Reservations(engine, replica_cpus=0.0, engine_bundle=0, engine_cpus=engine_cpus if tp == 1 else 0.0,
                        first_rank_bundle=0, ingress_cpus=0.0, rank_cpus=engine_cpus, cpu_share=share)
