"""infra/cluster.yaml through Ray's own cluster-config path, as `ray up` runs it before it reaches the cloud:
ray.autoscaler._private.util.prepare_config (the provider's defaults merged, node types filled in) and
validate_config (Ray's ray-schema.json plus its node-type checks); the `ray start` commands parsed by Ray's
own CLI. Not checked: the AWS side (instance types, AMI, credentials), which `ray up` resolves against AWS
itself, and the setup commands, which run only on the nodes."""

from __future__ import annotations

import copy
import re
import shlex

import click
import pytest
from jsonschema import ValidationError as SchemaError
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.scripts.scripts import start

from tests.infra.manifests import (API_KEY_ENV, CLUSTER, METRICS_PORT, SERVE_CONFIG_CLUSTER, app_args, load_yaml,
                                   makefile_torch_version)

KVSERVE_DIR = "/home/ray/kvserve"
KEY_FILE = "/home/ray/.kvserve/api_key"


@pytest.fixture
def cluster() -> dict:
    return load_yaml(CLUSTER)


def prepared(config: dict) -> dict:
    config = prepare_config(copy.deepcopy(config))
    validate_config(config)
    return config


def cluster_args():
    return app_args(load_yaml(SERVE_CONFIG_CLUSTER)["applications"][0]["args"])


def test_rays_validator_accepts_it(cluster):
    config = prepared(cluster)
    assert config["provider"]["type"] == "aws" and config["head_node_type"] == "ray.head.cpu"
    assert set(config["available_node_types"]) == {"ray.head.cpu", "ray.worker.gpu"}


@pytest.mark.parametrize("change", [
    lambda c: c["available_node_types"]["ray.worker.gpu"]["resources"].update(GPU="1"),
    lambda c: c["docker"].update(worker_run_option=["--gpus all"]),
    lambda c: c.update(head_node_type="ray.head.default"),
    lambda c: c["available_node_types"]["ray.worker.gpu"].update(min_workers=3),
])
def test_rays_validator_refuses_mistakes(cluster, change):
    broken = copy.deepcopy(cluster)
    change(broken)
    with pytest.raises((SchemaError, ValueError)):
        prepared(broken)


def test_a_cpu_head_and_gpu_workers(cluster):
    config = prepared(cluster)
    head = config["available_node_types"]["ray.head.cpu"]
    worker = config["available_node_types"]["ray.worker.gpu"]
    assert head["resources"]["GPU"] == 0 and head["max_workers"] == 0
    assert worker["resources"]["GPU"] == 1 and 1 <= worker["min_workers"] <= worker["max_workers"]
    assert config["max_workers"] >= worker["max_workers"]
    assert config["docker"]["worker_run_options"] == ["--gpus all"]
    assert "--gpus all" not in config["docker"]["run_options"]  # the head has no GPU to hand the container
    args = cluster_args()
    assert worker["max_workers"] * worker["resources"]["GPU"] >= args.replica_range[1] * args.tensor_parallel_size


def ray_start_options(command: str) -> dict:
    """The options of the `ray start` in a shell command, parsed by Ray's own CLI (unknown or mistyped
    flags raise), without running it."""
    words = shlex.split(command[command.index("ray start"):])
    assert words[:2] == ["ray", "start"]
    return start.make_context("start", words[2:]).params


def test_ray_starts_with_the_metrics_port_and_an_open_dashboard(cluster):
    config = prepared(cluster)
    head = ray_start_options(config["head_start_ray_commands"][-1])
    worker = ray_start_options(config["worker_start_ray_commands"][-1])
    assert (head["head"], head["num_gpus"], head["dashboard_host"], head["port"]) == (True, 0, "0.0.0.0", 6379)
    assert head["autoscaling_config"] == "~/ray_bootstrap_config.yaml"
    assert (worker["head"], worker["address"], worker["num_gpus"]) == (False, "$RAY_HEAD_IP:6379", None)
    for options in (head, worker):
        assert options["metrics_export_port"] == METRICS_PORT and options["object_manager_port"] == 8076
    with pytest.raises(click.UsageError):
        ray_start_options("ray start --head --num-gpu=0")


def test_every_node_installs_torch_then_this_checkout_and_the_model(cluster):
    config = prepared(cluster)
    assert config["docker"]["image"].startswith("rayproject/ray:")
    assert config["file_mounts"][KVSERVE_DIR] == "."  # `ray up` runs from the repository root
    assert {".venv", ".git"} <= set(config["rsync_exclude"])
    steps = config["setup_commands"]
    torch = steps.index(f'pip install --no-cache-dir "torch=={makefile_torch_version()}"')
    kvserve = steps.index(f'pip install --no-cache-dir "{KVSERVE_DIR}[gpu]"')
    model = next(i for i, step in enumerate(steps) if "snapshot_download" in step)
    assert torch < kvserve < model
    assert f"local_dir='{cluster_args().model}'" in steps[model]
    # head and workers alike (the app is built, and the tokenizer loaded, on any node)
    assert config["head_setup_commands"][:len(steps)] == steps and config["worker_setup_commands"] == steps


def test_each_node_exports_the_api_key_before_ray_starts(cluster):
    config = prepared(cluster)
    assert config["file_mounts"][KEY_FILE] == "~/.kvserve/api_key"
    assert load_yaml(SERVE_CONFIG_CLUSTER)["applications"][0]["args"]["api_key_env"] == API_KEY_ENV
    for commands in (config["head_start_ray_commands"], config["worker_start_ray_commands"]):
        command = commands[-1]
        export = re.search(rf'export {API_KEY_ENV}="\$\(cat {re.escape(KEY_FILE)}\)";', command)
        assert export and export.end() < command.index("ray start"), command
