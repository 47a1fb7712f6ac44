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


def test_conftest_restores_every_key_build_app_sets():
    from tests import conftest

    assert set(serve_app.SERVE_ENV) == set(conftest.SERVE_ENV_KEYS)


def test_make_serve_starts_serve_with_serve_env():
    """`make serve` runs `serve run infra/serve_config.yaml`, which builds the app after Ray started:
    the Makefile gives the proxy the settings in the command's environment."""
    makefile = open(os.path.join(os.path.dirname(serve_app.__file__), "Makefile")).read().replace("\\\n", " ")
    line = next(line for line in makefile.splitlines() if "serve run infra/serve_config.yaml" in line)
    assert all(f"{key}={value}" in line for key, value in serve_app.SERVE_ENV.items()), line
