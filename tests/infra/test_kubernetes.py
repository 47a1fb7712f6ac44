"""infra/k8s: the RayService against the KubeRay ray.io/v1 schema and the Kubernetes API's models, and the
model volume manifests against the Kubernetes API's models.

- KubeRay: no package reachable here ships the RayService CRD, so tests/infra/rayservice_v1_subset.schema.json
  is written by hand from KubeRay's v1 API types (the fields kvserve uses, their types, int32 ranges,
  enums, required fields, no unknown field) and applied with jsonschema; KubeRay's group rules (replica
  bounds) are checked below, and the rayStartParams are parsed by Ray's own `ray start` CLI.
- Kubernetes: the Pod templates, the serve Service and the model volume's PersistentVolumeClaim and Job
  are validated by the `kubernetes` client's generated models (pydantic, unknown fields forbidden, strict
  types: a resource quantity must be a string), plus some of the API server's field rules (port names,
  probe ports, volume references, env names) that the models do not carry.
Not checked: admission by a real API server and the operator's reconciliation (no cluster here)."""

from __future__ import annotations

import copy
import json
import re

import click
import pytest
import yaml
from jsonschema import Draft202012Validator, ValidationError as SchemaError
from kubernetes.client import V1Job, V1PersistentVolumeClaim, V1PodTemplateSpec, V1Service
from pydantic import ValidationError
from ray.scripts.scripts import start

from tests.infra.manifests import (API_KEY_ENV, GRPC_PORT, HTTP_PORT, METRICS_PORT, MODEL_VOLUME, RAYSERVICE_SCHEMA,
                                   app_args, container_port, load_all_yaml, pyproject, ray_container, ray_groups,
                                   rayservice)

IANA_SVC_NAME = re.compile(r"^(?=.{1,15}$)(?=.*[a-z])[a-z0-9]([a-z0-9-]*[a-z0-9])?$")  # container port names
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
SECRET = {"name": "kvserve-api-key", "key": "api-key"}
MODEL_CLAIM = "kvserve-models"


@pytest.fixture(scope="module")
def validator() -> Draft202012Validator:
    schema = json.loads(RAYSERVICE_SCHEMA.read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


@pytest.fixture
def service() -> dict:
    return rayservice()


def serve_args(service: dict):
    return app_args(yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"])


def test_the_rayservice_matches_kuberays_v1_schema(validator, service):
    assert service["apiVersion"] == "ray.io/v1" and service["kind"] == "RayService"
    assert list(validator.iter_errors(service)) == []


@pytest.mark.parametrize("mistake", [
    ("a misspelt spec field", lambda s: s["spec"].update(serveConfigv2=s["spec"].pop("serveConfigV2"))),
    ("a number as a rayStartParams value",
     lambda s: s["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].update({"num-gpus": 0})),
    ("a worker group without a name", lambda s: s["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].pop("groupName")),
    ("negative replicas", lambda s: s["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(minReplicas=-1)),
    ("an unknown upscaling mode",
     lambda s: s["spec"]["rayClusterConfig"]["autoscalerOptions"].update(upscalingMode="Fast")),
])
def test_the_schema_refuses_mistakes(validator, service, mistake):
    _, change = mistake
    broken = copy.deepcopy(service)
    change(broken)
    with pytest.raises(SchemaError):
        validator.validate(broken)


def test_pod_templates_and_serve_service_are_valid_kubernetes_objects(service):
    for group in ray_groups(service).values():
        V1PodTemplateSpec.model_validate(group["template"])
    V1Service.model_validate(service["spec"]["serveService"])
    broken = copy.deepcopy(ray_groups(service)["gpu"]["template"])
    broken["spec"]["containers"][0]["readinessprobe"] = broken["spec"]["containers"][0].pop("readinessProbe")
    with pytest.raises(ValidationError, match="readinessprobe"):
        V1PodTemplateSpec.model_validate(broken)
    broken = copy.deepcopy(ray_groups(service)["gpu"]["template"])
    broken["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = 1
    with pytest.raises(ValidationError, match="nvidia.com/gpu"):
        V1PodTemplateSpec.model_validate(broken)


def test_api_server_field_rules(service):
    """Rules the API server applies that the models do not: port names, named probe ports that exist,
    volume mounts of declared volumes, environment variable names, unique names."""
    for name, group in ray_groups(service).items():
        spec = group["template"]["spec"]
        volumes = [v["name"] for v in spec["volumes"]]
        assert len(volumes) == len(set(volumes))
        for container in spec["containers"]:
            ports = [p["name"] for p in container["ports"]]
            assert len(ports) == len(set(ports)) and all(IANA_SVC_NAME.match(p) for p in ports), ports
            for probe in ("readinessProbe", "livenessProbe"):
                port = container[probe].get("httpGet", {}).get("port")
                assert port is None or isinstance(port, int) or port in ports, (name, probe, port)
            assert {m["name"] for m in container["volumeMounts"]} <= set(volumes)
            assert all(ENV_NAME.match(e["name"]) for e in container["env"])


def test_head_has_no_gpus_and_the_worker_group_one_gpu_each(service):
    groups = ray_groups(service)
    head = groups.pop("head")
    assert head["rayStartParams"]["num-gpus"] == "0"
    head_resources = ray_container(head)["resources"]
    assert not any("gpu" in key for part in head_resources.values() for key in part)
    assert set(groups) == {"gpu"}
    gpu = groups["gpu"]
    resources = ray_container(gpu)["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == "1"
    assert 0 <= gpu["minReplicas"] <= gpu["replicas"] <= gpu["maxReplicas"]
    gpus_per_worker = int(resources["limits"]["nvidia.com/gpu"])
    args = serve_args(service)
    # every LLMServer replica reserves tensor_parallel_size GPUs, packed on one node (STRICT_PACK), and the
    # group can grow to hold max_replicas of them
    assert args.placement_strategy == "STRICT_PACK" and args.tensor_parallel_size <= gpus_per_worker
    assert gpu["maxReplicas"] * (gpus_per_worker // args.tensor_parallel_size) >= args.replica_range[1]
    assert service["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    for group in ray_groups(service).values():  # Pods with a fixed size: requests equal limits
        for kind in ("cpu", "memory"):
            assert ray_container(group)["resources"]["requests"][kind] == ray_container(group)["resources"]["limits"][kind]


def test_ray_start_params_are_ray_start_options(service):
    """KubeRay passes rayStartParams to `ray start` as --key=value: Ray's own CLI parses them here."""
    parsed = {}
    for name, group in ray_groups(service).items():
        role = ["--head"] if name == "head" else ["--address=kvserve-head-svc:6379"]
        flags = [f"--{key}={value}" for key, value in group["rayStartParams"].items()]
        parsed[name] = start.make_context("start", role + flags).params
    assert (parsed["head"]["num_gpus"], parsed["head"]["dashboard_host"]) == (0, "0.0.0.0")
    assert parsed["gpu"]["num_gpus"] is None  # KubeRay sets it from the container's nvidia.com/gpu limit
    assert {options["metrics_export_port"] for options in parsed.values()} == {METRICS_PORT}
    with pytest.raises(click.UsageError):
        start.make_context("start", ["--head", "--num-gpu=0"])


def test_ports_http_grpc_and_ray_metrics(service):
    served = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert (served["http_options"]["port"], served["grpc_options"]["port"]) == (HTTP_PORT, GRPC_PORT)
    for name, group in ray_groups(service).items():
        container = ray_container(group)
        assert container_port(container, "serve") == HTTP_PORT
        assert container_port(container, "grpc") == GRPC_PORT
        assert container_port(container, "metrics") == METRICS_PORT
        assert group["rayStartParams"]["metrics-export-port"] == str(METRICS_PORT)
    head = ray_container(ray_groups(service)["head"])
    assert (container_port(head, "gcs-server"), container_port(head, "dashboard")) == (6379, 8265)
    ports = {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["serveService"]["spec"]["ports"]}
    assert ports == {"serve": (HTTP_PORT, HTTP_PORT), "grpc": (GRPC_PORT, GRPC_PORT)}


def test_probes(service):
    """Workers are ready when /health answers through their Serve proxy; liveness never depends on the
    application (an engine restart must not restart the Pod); the head's readiness is Ray's, since
    KubeRay submits the Serve config only once the head Pod is ready."""
    groups = ray_groups(service)
    worker = ray_container(groups["gpu"])
    ready = worker["readinessProbe"]["httpGet"]
    assert ready["path"] == "/health" and container_port(worker, ready["port"]) == HTTP_PORT
    assert worker["livenessProbe"]["httpGet"] == {"path": "/api/local_raylet_healthz", "port": 52365}
    head = ray_container(groups["head"])
    for probe in ("readinessProbe", "livenessProbe"):
        command = " ".join(head[probe]["exec"]["command"])
        assert re.search(r"/health\b", command) is None
        assert "localhost:52365/api/local_raylet_healthz" in command and "localhost:8265/api/gcs_healthz" in command
    for container in (head, worker):  # a dead process is found within minutes, a slow start is not killed
        live = container["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] >= 600


def test_the_api_key_comes_from_a_secret(service):
    served = yaml.safe_load(service["spec"]["serveConfigV2"])
    args = served["applications"][0]["args"]
    assert "api_key" not in args and args["api_key_env"] == API_KEY_ENV
    assert serve_args(service).api_key is None
    for name, group in ray_groups(service).items():  # the Ingress may run on any node
        env = {e["name"]: e for e in ray_container(group)["env"]}
        assert env[API_KEY_ENV] == {"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": SECRET}}, name


def test_the_model_comes_from_the_model_volume(service):
    model = serve_args(service).model
    for name, group in ray_groups(service).items():  # the app is built, and the tokenizer loaded, on any node
        spec = group["template"]["spec"]
        volume = next(v for v in spec["volumes"] if v.get("persistentVolumeClaim"))
        assert volume["persistentVolumeClaim"] == {"claimName": MODEL_CLAIM, "readOnly": True}
        mount = next(m for m in ray_container(group)["volumeMounts"] if m["name"] == volume["name"])
        assert mount["readOnly"] is True and model.startswith(mount["mountPath"].rstrip("/") + "/"), (name, mount)


def test_the_model_volume_and_its_download_job(service):
    claim, job = load_all_yaml(MODEL_VOLUME)
    claim_model, job_model = V1PersistentVolumeClaim.model_validate(claim), V1Job.model_validate(job)
    assert (claim["kind"], claim["apiVersion"], job["kind"], job["apiVersion"]) == (
        "PersistentVolumeClaim", "v1", "Job", "batch/v1")
    assert claim_model.metadata.name == MODEL_CLAIM
    assert claim_model.spec.access_modes == ["ReadWriteMany"]  # every Ray Pod mounts it, the Job writes it
    pod = job_model.spec.template.spec
    assert pod.restart_policy == "OnFailure"
    (container,) = pod.containers
    env = {e.name: e for e in container.env}
    model = serve_args(service).model
    assert env["MODEL_DIR"].value == model and env["MODEL_ID"].value.count("/") == 1
    assert env["HF_TOKEN"].value_from.secret_key_ref.optional is True
    (volume,) = pod.volumes
    assert volume.persistent_volume_claim.claim_name == MODEL_CLAIM
    (mount,) = container.volume_mounts
    assert mount.name == volume.name and not mount.read_only and model.startswith(mount.mount_path + "/")
    assert container.image == ray_container(ray_groups(service)["head"])["image"]
    assert 'local_dir=os.environ["MODEL_DIR"]' in container.command[-1]


def test_one_image_tagged_with_the_project_version(service):
    images = {ray_container(group)["image"] for group in ray_groups(service).values()}
    (image,) = images
    assert image.rsplit(":", 1)[1] == pyproject()["project"]["version"]
