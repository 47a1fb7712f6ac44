"""`make test`'s two runs (tests/run_pools.py): every test module in exactly one of them, paths on the
command line routed to theirs, and the exit status of the two together."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.run_pools import CLUSTER_PATHS, ROOT, compute_paths, split_args


def _modules_under(paths) -> set[Path]:
    found = set()
    for rel in paths:
        path = ROOT / rel
        found |= {path} if path.is_file() else set(path.rglob("test_*.py"))
    return found


def test_every_test_module_runs_in_exactly_one_pool():
    every = set((ROOT / "tests").rglob("test_*.py"))
    cluster, compute = _modules_under(CLUSTER_PATHS), _modules_under(compute_paths())
    assert cluster and compute and not cluster & compute
    assert cluster | compute == every, sorted(str(p) for p in every ^ (cluster | compute))
    assert ROOT / "tests/cluster/test_pipeline_parallel.py" in cluster
    assert ROOT / "tests/kernels/test_cpu_envelope.py" in compute and Path(__file__) in compute


def test_paths_go_to_their_pool_and_options_to_both(monkeypatch):
    monkeypatch.chdir(ROOT / "tests")  # paths as the user typed them, from where they stand
    node = "serve/test_chaos.py::test_soak_reports_every_process_errors_and_blocks"
    options, cluster, compute = split_args(["-x", "-k", "moe", "kernels/test_cpu_moe.py", node, "benchmarks",
                                            "--durations=5"])
    assert options == ["-x", "-k", "moe", "--durations=5"]
    assert cluster == [str(ROOT / "tests" / node.split("::")[0]) + "::" + node.split("::")[1],
                       str(ROOT / "tests/benchmarks")]
    assert compute == [str(ROOT / "tests/kernels/test_cpu_moe.py")]
    # the whole tests directory: each pool its own share of it, no module in both
    _, cluster, compute = split_args(["."])
    assert cluster == [str(ROOT / p) for p in CLUSTER_PATHS]
    assert compute == [str(ROOT / p) for p in compute_paths()]


@pytest.mark.parametrize("keyword,code", [("test_page_names_only_what_exists", 0), ("no_test_has_this_name", 5)])
def test_a_run_that_selects_nothing_fails_nothing_unless_both_do(keyword, code):
    """The docs' tests (compute, niced) beside a benchmarks module (cluster) under a keyword only the
    first matches: the cluster run selects nothing (pytest's 5) and the whole passes; a keyword neither
    matches gives 5."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run([sys.executable, "-m", "tests.run_pools", "tests/docs/test_docs_links.py",
                           "tests/benchmarks/test_workloads.py", "-k", keyword],
                          cwd=ROOT, env={**env, "KVSERVE_CLUSTER_JOBS": "1", "KVSERVE_COMPUTE_JOBS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == code, done.stdout[-3000:] + done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("[cluster] pytest exited 5 after ") for line in lines), done.stdout[-2000:]
    expected = "[compute] pytest exited 0 after " if code == 0 else "[compute] pytest exited 5 after "
    assert any(line.startswith(expected) for line in lines), done.stdout[-2000:]
