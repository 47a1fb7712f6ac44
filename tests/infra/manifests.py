"""The deployment files under infra/, loaded for the tests of tests/infra (nothing here starts Ray)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
DOCKERFILE = INFRA / "Dockerfile"
RAYSERVICE = INFRA / "k8s" / "rayservice.yaml"
MODEL_VOLUME = INFRA / "k8s" / "model-volume.yaml"
CLUSTER = INFRA / "cluster.yaml"
SERVE_CONFIG = INFRA / "serve_config.yaml"
SERVE_CONFIG_CLUSTER = INFRA / "serve_config_cluster.yaml"
RAYSERVICE_SCHEMA = Path(__file__).with_name("rayservice_v1_subset.schema.json")

HTTP_PORT, GRPC_PORT, METRICS_PORT = 8000, 9000, 8080
API_KEY_ENV = "KVSERVE_API_KEY"
GRPC_SERVICER = "api.kvserve_pb2_grpc.add_KVServeServicer_to_server"

def load_yaml(path: Path) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


def load_all_yaml(path: Path) -> list[dict]:
    with open(path) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def makefile_torch_version() -> str:
    """The torch version `make install` pins (TORCH_SPEC ?= torch==X)."""
    match = re.search(r"^TORCH_SPEC \?= torch==(\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert match, "the Makefile no longer pins torch with `TORCH_SPEC ?= torch==X`"
    return match.group(1)


def app_args(args: dict):
    """serve_app.AppArgs validated from an application's `args` (raises pydantic's ValidationError)."""
    from serve_app import AppArgs

    return AppArgs.model_validate(args)


def rayservice() -> dict:
    return load_yaml(RAYSERVICE)


def ray_groups(service: dict) -> dict[str, dict]:
    """'head' and each worker group name -> its group spec."""
    cluster = service["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"], **{g["groupName"]: g for g in cluster.get("workerGroupSpecs", [])}}


def ray_container(group: dict) -> dict:
    """The Ray container of a group's Pod: KubeRay runs Ray in the first container."""
    return group["template"]["spec"]["containers"][0]


def container_port(container: dict, name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert name in ports, f"{container['name']} has no port named {name!r}: {sorted(ports)}"
    return ports[name]
