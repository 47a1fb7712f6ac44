"""The Serve configs under infra/ (and the RayService's serveConfigV2, which is the cluster one), loaded
through Serve's own schema (ray.serve.schema.ServeDeploySchema, what `serve deploy` and KubeRay submit
through), with no key Serve would ignore, each application's args through serve_app.AppArgs, and the
import paths resolved. Nothing here starts Ray or Serve; building the app (which reads the model
directory on the cluster's nodes) is not checked."""

from __future__ import annotations

import importlib

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import HTTPOptionsSchema, ServeApplicationSchema, ServeDeploySchema, gRPCOptionsSchema

import serve_app
from tests.infra.manifests import (API_KEY_ENV, GRPC_PORT, GRPC_SERVICER, HTTP_PORT, SERVE_CONFIG, SERVE_CONFIG_CLUSTER,
                                   app_args, load_yaml, rayservice)

CONFIGS = {"local": SERVE_CONFIG, "cluster": SERVE_CONFIG_CLUSTER}


def unknown_keys(data: dict, schema) -> set[str]:
    """Keys Serve's schema does not define: ServeDeploySchema and its options accept and ignore them."""
    return set(data) - set(schema.model_fields)


@pytest.mark.parametrize("name", CONFIGS)
def test_loads_through_serves_schema_with_no_ignored_key(name):
    data = load_yaml(CONFIGS[name])
    config = ServeDeploySchema.model_validate(data)
    assert unknown_keys(data, ServeDeploySchema) == set()
    assert unknown_keys(data["http_options"], HTTPOptionsSchema) == set()
    assert unknown_keys(data["grpc_options"], gRPCOptionsSchema) == set()
    for app in data["applications"]:
        assert unknown_keys(app, ServeApplicationSchema) == set()
    assert (config.http_options.port, config.grpc_options.port) == (HTTP_PORT, GRPC_PORT)
    assert config.grpc_options.grpc_servicer_functions == [GRPC_SERVICER]
    assert [(app.name, app.route_prefix, app.import_path) for app in config.applications] == [
        ("kvserve", "/", "serve_app:app")]


@pytest.mark.parametrize("name", CONFIGS)
def test_import_paths_resolve(name):
    config = ServeDeploySchema.model_validate(load_yaml(CONFIGS[name]))
    module, attr = config.applications[0].import_path.split(":")
    assert getattr(importlib.import_module(module), attr) is serve_app.build_app
    for path in config.grpc_options.grpc_servicer_functions:
        module, attr = path.rsplit(".", 1)
        assert callable(getattr(importlib.import_module(module), attr))


@pytest.mark.parametrize("name", CONFIGS)
def test_args_are_app_args(name):
    config = ServeDeploySchema.model_validate(load_yaml(CONFIGS[name]))
    args = app_args(config.applications[0].args)
    assert args.tensor_parallel_size == 1 and args.api_key is None  # a key never sits in a config file


def test_app_args_catch_a_misspelt_or_mistyped_key():
    args = load_yaml(SERVE_CONFIG_CLUSTER)["applications"][0]["args"]
    for bad in ({"max_num_seq": 64}, {"device": "gpu"}, {"max_replicas": "two"}, {"num_replicas": 2}):
        with pytest.raises(ValidationError):
            app_args({**args, **bad})


def test_the_local_config_listens_on_loopback_only():
    config = ServeDeploySchema.model_validate(load_yaml(SERVE_CONFIG))
    assert config.http_options.host == "127.0.0.1"


def test_the_cluster_config_serves_every_node_on_all_interfaces():
    data = load_yaml(SERVE_CONFIG_CLUSTER)
    config = ServeDeploySchema.model_validate(data)
    assert config.http_options.host == "0.0.0.0"
    assert config.proxy_location.value == "EveryNode"
    app = config.applications[0]
    assert app.runtime_env == {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}
    args = app_args(app.args)
    # the GPU workers may not have joined when the app is built: the device is named, not detected
    assert (args.device, args.dtype) == ("cuda", "bfloat16")
    assert args.model.startswith("/models/") and args.autoscaling and args.replica_range == (1, 2)
    assert app.args["api_key_env"] == API_KEY_ENV


def test_the_rayservice_serves_the_cluster_config():
    served = yaml.safe_load(rayservice()["spec"]["serveConfigV2"])
    assert served == load_yaml(SERVE_CONFIG_CLUSTER)
