"""The layering rules of docs/architecture.md, checked on the source."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = {"engine", "workers", "cluster", "kernels", "api", "benchmarks", "serve_app"}


def imported_modules(package: str) -> dict[str, set[str]]:
    """file -> top-level modules it imports (anywhere in the file, lazy imports included)."""
    result = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        result[str(path.relative_to(ROOT))] = names
    return result


def test_engine_imports_neither_torch_nor_ray():
    for path, names in imported_modules("engine").items():
        assert not names & {"torch", "ray", "transformers"}, f"{path} imports {names & {'torch', 'ray'}}"
        assert not names & (PROJECT - {"engine"}), f"{path} imports {names & PROJECT} (executors go by name)"
    code = "import sys, engine; from engine import LLM, AsyncLLM; print(sorted(m for m in ('torch', 'ray') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_kernels_import_nothing_of_the_project():
    for path, names in imported_modules("kernels").items():
        assert not names & (PROJECT - {"kernels"}), f"{path} imports {names & PROJECT}"


def test_only_the_cluster_layer_imports_ray():
    for package in ("engine", "workers", "kernels", "api"):
        for path, names in imported_modules(package).items():
            assert "ray" not in names, f"{path} imports ray"


def _kernels_import_graph() -> dict[str, set[str]]:
    """kernels module -> the kernels modules it imports (lazy imports included)."""
    modules = {}
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.add(node.module)
                targets.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def test_kernels_have_no_import_cycle():
    """Between the kernels' modules (a package importing its own submodules aside), no module imports
    one that imports it back, directly or around a longer circle."""
    graph = _kernels_import_graph()
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in graph[name]:
            if target.startswith(name + "."):  # a package and its submodules
                continue
            assert state.get(target) != 1, f"import cycle: {' -> '.join(path + [target])}"
            if target not in state:
                visit(target, path + [target])
        state[name] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])


def test_starting_an_engine_process_does_not_import_torch_dynamo():
    """torch._dynamo (imported by torch.nn.attention.bias, torch.compile, ...) adds about 2 s to the
    start of every process that imports it: engines, Ray rank actors, Serve replicas."""
    code = ("import sys, engine, kernels, workers.executor, workers.worker, cluster.scheduler_actor, "
            "cluster.worker_actor; print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
