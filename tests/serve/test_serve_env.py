"""Serve's serving-path settings (serve_app.SERVE_ENV): set in the process that builds the app before
Ray starts (the cluster `serve run` starts inherits them, Serve's proxy included) and carried by both
deployments; an environment that sets them wins."""

from __future__ import annotations

import os

import ray

import serve_app


def _env_vars(deployment) -> dict:
    return deployment.ray_actor_options["runtime_env"]["env_vars"]


def test_both_deployments_carry_serve_env_and_the_environment_wins(model_dirs, monkeypatch):
    assert not ray.is_initialized()
    for key in serve_app.SERVE_ENV:  # absent now, and again after the test (build_app sets them)
        monkeypatch.setenv(key, "unset")
        monkeypatch.delenv(key)
    app = serve_app.build_app({"model": model_dirs["llama"]})
    ingress = app._bound_deployment
    llm_server = ingress.init_args[0]._bound_deployment
    assert _env_vars(ingress) == _env_vars(llm_server) == serve_app.SERVE_ENV
    assert {key: os.environ[key] for key in serve_app.SERVE_ENV} == serve_app.SERVE_ENV  # for the local cluster
    monkeypatch.setenv("RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP", "1")
    app = serve_app.build_app({"model": model_dirs["llama"]})
    assert _env_vars(app._bound_deployment)["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "1"
