"""Connecting to Ray: the cluster at RAY_ADDRESS when set, else a local one started here."""

from __future__ import annotations

import os

import ray


def ensure_ray(min_cpus: int = 1) -> None:
    """Initialise Ray once per process. A local cluster gets at least ``min_cpus`` logical CPUs
    (logical CPUs may exceed the cores: a tensor-parallel group on a small machine still places)."""
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(num_cpus=max(os.cpu_count() or 1, min_cpus), include_dashboard=False, log_to_driver=True)


def cluster_has_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0
