"""Shared fixtures: tiny checkpoints of every architecture, built once per session, and the
Hugging Face transformers oracle that judges our outputs by teacher forcing."""

from __future__ import annotations

import os
import sys

import pytest

from cluster.serve_env import NODE_ENV

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# every stop of a Serve app behind HAProxy waits this long for its Ingress replicas to drain (the users'
# default is 5 s, ``cluster/serve_env.py``, which tests/serve/test_serve_env.py checks with the
# environment cleared): the suite stops a few dozen apps
os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")
# every Ray cluster the suite starts (ray.init in a fixture, `serve run`, `ray start`) gets the node
# tolerances `serve run` gives a local cluster of its own (``cluster/serve_env.py``: a raylet may miss 20
# health checks, a new Serve proxy may take up to 60 s to start, not 15): beside the other workers on 2 cores a
# proxy took over 15 s to start, Serve killed it, and every test of that module failed
for _key, _value in NODE_ENV.items():
    os.environ.setdefault(_key, _value)


def pytest_configure(config):
    """The Triton kernels' tests (``tests/kernels/triton``) run on CPU tensors under the Triton
    interpreter. ``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is decorated: the
    kernels' (``kernels.triton.ops``) and triton.language's own (``tl.zeros`` and the like), and
    ``import torch`` imports triton where it is installed. So it is set here, before any test module
    is collected (and imports torch); not when the run selects the ``gpu`` tests (``-m gpu``), which
    run the same kernels compiled on CUDA (``tests/gpu``)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        # each xdist worker its own Ray temp dir: ray.init() with no address joins the cluster a `ray start`
        # on this machine last recorded there (a test of the other worker may have one running)
        os.environ["RAY_TMPDIR"] = os.path.join(os.environ.get("RAY_TMPDIR", "/tmp"), f"ray-{worker}")
        os.makedirs(os.environ["RAY_TMPDIR"], exist_ok=True)
    if os.environ.get("KVSERVE_TEST_POOL") == "compute":
        _refuse_ray_in_the_compute_pool()
    if (config.getoption("markexpr") or "").replace(" ", "") == "gpu":
        return
    assert "triton.language" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1", (
        "triton was imported before the test session could set TRITON_INTERPRET=1")
    os.environ["TRITON_INTERPRET"] = "1"


def _refuse_ray_in_the_compute_pool() -> None:
    """`make test` (tests/run_pools.py) runs every module outside tests/cluster, tests/serve and
    tests/benchmarks at nice 19: a Ray cluster started there would wait on each hand-off behind the
    other run's work. Such a module belongs in the cluster pool; starting Ray says so."""
    import ray

    def refuse(*args, **kwargs):
        raise RuntimeError("this test starts Ray, but it runs in the compute pool of tests/run_pools.py (nice 19): "
                           "move its module under tests/cluster, tests/serve or tests/benchmarks")

    ray.init = refuse


# The longest modules (seconds on the 2-core VM: the sum of their tests among the 40 slowest of a fresh
# clone's `make test` with three workers, 2026-12-06 18:19, or among the 120 slowest of an earlier run
# with two where that is larger; the PP and chaos modules after fewer engine starts, 2026-12-06 21:00),
# run first: ``make test`` spreads modules over its pytest-xdist workers
# (``--dist loadfile``, each worker taking the next module in order when it is free), so the long ones
# starting first leave short ones for the end instead of one worker running a long module while the
# others wait.
LONG_MODULES = {
    "tests/cluster/test_pipeline_parallel.py": 250, "tests/serve/test_chaos.py": 130,
    "tests/serve/test_pipeline_serve.py": 151, "tests/serve/test_engine_recovery.py": 149,
    "tests/kernels/triton/test_triton_compile.py": 146, "tests/serve/test_serve_cli.py": 142,
    "tests/kernels/test_cpu_build.py": 137, "tests/cluster/test_triton_tp.py": 129,
    "tests/serve/test_serve_env.py": 113, "tests/serve/test_overload.py": 106,
    "tests/kernels/triton/test_triton_warmup.py": 93, "tests/cluster/test_pipeline_failures.py": 88,
    "tests/serve/test_fleet.py": 78, "tests/cluster/test_tensor_parallel.py": 70,
    "tests/kernels/triton/test_triton_graphs.py": 59, "tests/cluster/test_pp_beyond_one_node.py": 57,
    "tests/cluster/test_pipeline_parallel_families.py": 52, "tests/serve/test_autoscaling.py": 48,
    "tests/kernels/triton/test_triton_gemma.py": 43, "tests/kernels/triton/test_triton_moe.py": 42,
    "tests/kernels/triton/test_triton_deterministic.py": 40, "tests/serve/test_serve_app.py": 39,
    "tests/benchmarks/test_fresh_bench.py": 38, "tests/cluster/test_gemma_tp.py": 36,
    "tests/e2e/test_kv_quant.py": 35, "tests/serve/test_dashboard_serve.py": 34,
    "tests/cluster/test_memory_plan.py": 32, "tests/benchmarks/test_gpu_bench.py": 28,
    "tests/cluster/test_multinode.py": 25, "tests/benchmarks/test_online_vllm.py": 25,
    "tests/cluster/test_failure_recovery.py": 24, "tests/cluster/test_moe_parallel.py": 21,
    "tests/cluster/test_host_tier_tp.py": 20
}


def pytest_collection_modifyitems(config, items):
    """The modules of ``LONG_MODULES`` first, longest first; the rest in their usual order."""
    def weight(item) -> float:
        path = item.nodeid.split("::", 1)[0]
        return -LONG_MODULES.get(path, 0)

    items.sort(key=weight)  # stable: a module's tests keep their order


ARCHS = ("llama", "qwen2", "opt")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """arch -> directory of its `tiny` preset, built with the project's own model builder."""
    from workers.model_builder import make_model

    root = tmp_path_factory.mktemp("models")
    return {arch: str(make_model(arch, "tiny", root / f"{arch}-tiny", seed=0)) for arch in ARCHS}


class HFOracle:
    """transformers on the same checkpoint, float32, eager attention."""

    def __init__(self, model_dir: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager"
        ).eval()

    def logits(self, token_ids: list[int]):
        with self.torch.no_grad():
            return self.model(self.torch.tensor([token_ids])).logits[0].float()

    def assert_greedy(self, prompt_ids: list[int], output_ids: list[int], tol: float = 1e-3, penalize=None) -> None:
        """Each generated token must be within ``tol`` of the best logit HF gives at its position,
        under teacher forcing (HF reads prompt + our outputs in one forward). ``penalize(logits,
        history)`` transforms a row first (to check penalties)."""
        assert output_ids, "nothing was generated"
        logits = self.logits(prompt_ids + output_ids)
        for i, token in enumerate(output_ids):
            row = logits[len(prompt_ids) - 1 + i]
            if penalize is not None:
                row = penalize(row.clone(), prompt_ids, output_ids[:i])
            best = float(row.max())
            assert float(row[token]) >= best - tol, (
                f"token {i} ({token}) has logit {float(row[token]):.6f}, best is "
                f"{int(row.argmax())} at {best:.6f}"
            )

    def log_softmax(self, token_ids: list[int]):
        return self.torch.log_softmax(self.logits(token_ids), dim=-1)


def oracles_of(dirs: dict[str, str]):
    """``get(arch)``: the HFOracle of ``dirs[arch]``, made once on first use."""
    cache: dict[str, HFOracle] = {}

    def get(arch: str) -> HFOracle:
        if arch not in cache:
            cache[arch] = HFOracle(dirs[arch])
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def hf_oracle(model_dirs):
    return oracles_of(model_dirs)


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory) -> dict[str, str]:
    """qwen3 and phi3 ``tiny`` checkpoints, for their own test files only (``tests.e2e.families``)."""
    from tests.e2e.families import FAMILIES
    from workers.model_builder import make_model

    root = tmp_path_factory.mktemp("families")
    return {arch: str(make_model(arch, "tiny", root / f"{arch}-tiny", seed=0)) for arch in FAMILIES}


@pytest.fixture(scope="session")
def family_oracle(family_dirs):
    return oracles_of(family_dirs)


@pytest.fixture(scope="session")
def stress_runs(family_dirs):
    """(arch, backend) -> ``tests.e2e.families.stress_run``, once per session (the TP 2 tests compare with it)."""
    from tests.e2e.families import stress_run

    cache: dict[tuple[str, str], dict] = {}

    def get(arch: str, backend: str) -> dict:
        if (arch, backend) not in cache:
            cache[arch, backend] = stress_run(family_dirs[arch], backend)
        return cache[arch, backend]

    return get


HF_REPO_ID = "kvserve-test/tiny-llama"


@pytest.fixture(scope="session")
def hf_cache(model_dirs, tmp_path_factory) -> dict[str, str]:
    """A Hugging Face hub cache laid out by hand (as the hub's downloads leave it) holding the tiny llama
    as ``HF_REPO_ID`` at one commit: ``{"cache": dir, "repo_id", "commit", "snapshot": dir}``."""
    import hashlib
    from pathlib import Path

    cache = tmp_path_factory.mktemp("hf-hub")
    commit = hashlib.sha1(HF_REPO_ID.encode()).hexdigest()
    repo = cache / ("models--" + HF_REPO_ID.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    blobs = repo / "blobs"
    blobs.mkdir(parents=True)
    for file in sorted(Path(model_dirs["llama"]).rglob("*")):
        if not file.is_file():
            continue
        data = file.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / file.relative_to(model_dirs["llama"])
        link.parent.mkdir(parents=True, exist_ok=True)
        ups = len(link.relative_to(repo / "snapshots").parts)  # from the link's directory up to the repo's
        link.symlink_to(Path("../" * ups + "blobs") / blob.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    assert (snapshot / "config.json").read_bytes() == (Path(model_dirs["llama"]) / "config.json").read_bytes()
    return {"cache": str(cache), "repo_id": HF_REPO_ID, "commit": commit, "snapshot": str(snapshot)}


SERVE_ENV_KEYS = ("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP",
                  "RAY_SERVE_PROXY_USE_GRPC", "RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S",
                  "RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_HAPROXY_STATS_PORT",
                  "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "RAY_health_check_failure_threshold",
                  "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S")


@pytest.fixture(autouse=True)
def _serve_env_restored():
    """``serve_app.build_app`` sets Serve's settings (``SERVE_ENV``) in this process's environment when
    Ray is not running, as `serve run` needs; here each test finds the environment as it was."""
    saved = {key: os.environ.get(key) for key in SERVE_ENV_KEYS}
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
