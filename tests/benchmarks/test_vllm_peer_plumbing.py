"""The vLLM peer's plumbing without vLLM: `kvserve bench --vllm-python` against a fake runner that
speaks the runner protocol (benchmarks/fresh.py), and the pure parts of the real runner."""

from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path

import pytest

from benchmarks import vllm_runner
from benchmarks.cli import bench
from benchmarks.fresh import REPO_ROOT, VLLM_RUNNER, RunnerError, make_spec, run_spec, runner_command, runner_env
from benchmarks.report import format_markdown
from benchmarks.workloads import build_workload
from engine import LLM, SamplingParams

SCALE, OUTPUT_LEN = 0.0625, 4

# A stand-in for a vLLM venv's python: run as `<it> benchmarks/vllm_runner.py SPEC RESULT`, it logs what
# it was given, returns the token ids of $FAKE_TOKENS (one wrong in vllm-nocache's first instance), and
# times every instance so that the first takes 2 s and the steady one 1 s.
FAKE_RUNNER = """\
#!{python}
import json, os, sys, time
runner, spec_path, result_path = sys.argv[1:4]
spec = json.load(open(spec_path))
with open(os.environ["FAKE_SEEN"], "a") as f:
    f.write(json.dumps({{"argv": sys.argv, "spec": spec, "env": {{k: os.environ.get(k) for k in
        ("OMP_NUM_THREADS", "VLLM_ENABLE_V1_MULTIPROCESSING", "PYTHONPATH", "VLLM_CPU_KVCACHE_SPACE")}}}}) + "\\n")
print("INFO a line of vLLM's log", flush=True)
time.sleep(float(os.environ.get("FAKE_SLEEP", "0")))
if os.environ.get("FAKE_FAIL"):
    print("boom", flush=True)
    sys.exit(3)
tokens = json.load(open(os.environ["FAKE_TOKENS"]))
steady_s = 1.0
if os.environ.get("FAKE_ROUNDS"):  # every other process is twice as fast in its steady instance
    count = int(open(os.environ["FAKE_ROUNDS"]).read() or 0) if os.path.exists(os.environ["FAKE_ROUNDS"]) else 0
    open(os.environ["FAKE_ROUNDS"], "w").write(str(count + 1))
    steady_s = 0.5 if count % 2 else 1.0
instances = []
for k, item in enumerate(spec["instances"]):
    label, requests = item["label"], item["workload"]["requests"]
    ids = [list(t) for t in tokens[label]]
    if spec["system"] == "vllm-nocache" and label == "first":
        ids[0][-1] += 1
    records = []
    for r, t in zip(requests, ids):
        times = [100.1 + 0.01 * j for j in range(r["output_len"])]
        records.append({{"prompt_tokens": len(r["prompt"]), "arrival": 100.0, "chunk_times": times,
                        "chunk_tokens": [1] * len(times), "end": times[-1], "cached_tokens": None, "error": None,
                        "token_ids": t}})
        print("@@bench-progress 1", flush=True)
    instances.append({{"label": label, "elapsed_s": 2.0 if label == "first" else steady_s, "records": records,
                      "extra": {{"mode": "offline", "vllm_ttft_s": [0.25] * len(requests)}}}})
json.dump({{"system": spec["system"], "pid": os.getpid(), "start_s": 30.0, "import_s": 5.0, "instances": instances,
           "info": {{}}, "torch_threads": int(os.environ["OMP_NUM_THREADS"]),
           "omp_num_threads": os.environ["OMP_NUM_THREADS"], "versions": {{"vllm": "0.0-fake"}}}},
          open(result_path, "w"))
"""


@pytest.fixture(scope="module")
def fake(tmp_path_factory, model_dirs):
    """(fake python, the log of what it saw, the kvserve greedy tokens it returns)."""
    root = tmp_path_factory.mktemp("fake-vllm")
    python = root / "python"
    python.write_text(FAKE_RUNNER.format(python=sys.executable))
    python.chmod(0o755)
    tokens = {}
    with LLM(model=model_dirs["llama"], max_model_len=1024) as llm:
        for v, label in enumerate(("first", "steady")):
            w = build_workload("shared-system-prompt", model_dirs["llama"], SCALE, OUTPUT_LEN, variant=v)
            outs = llm.generate([{"prompt_token_ids": r.prompt} for r in w.requests],
                                SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True))
            tokens[label] = [o.outputs[0].token_ids for o in outs]
    (root / "tokens.json").write_text(json.dumps(tokens))
    return python, root / "seen.jsonl", root / "tokens.json"


@pytest.fixture(scope="module")
def report(fake, model_dirs):
    python, seen, tokens = fake
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FAKE_SEEN", str(seen))
        mp.setenv("FAKE_TOKENS", str(tokens))
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "40")  # must not reach the runner: the spec's KV bytes decide
        mp.setenv("PYTHONPATH", str(REPO_ROOT))
        return bench(model_dirs["llama"], workloads=["shared-system-prompt"],
                     systems=["kvserve-cache", "vllm-nocache", "vllm-cache"], scale=SCALE, output_len=OUTPUT_LEN,
                     max_num_seqs=32, max_num_batched_tokens=512, kv_cache_gib=0.0625, vllm_python=str(python),
                     vllm_threads=1, overhead_seqs=0, progress=False)


def test_runner_gets_the_same_settings_as_kvserve(report, fake):
    seen = [json.loads(line) for line in fake[1].read_text().splitlines()]
    assert [s["spec"]["system"] for s in seen] == ["vllm-nocache", "vllm-cache"]
    section = report["workloads"]["shared-system-prompt"]
    for s, caching in zip(seen, (False, True)):
        assert s["argv"][1] == str(VLLM_RUNNER)
        assert s["env"] == {"OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": None,
                            "VLLM_CPU_KVCACHE_SPACE": None}
        assert s["spec"]["threads"] == 1
        assert s["spec"]["engine"] == {"block_size": 32, "enable_prefix_caching": caching, "max_num_seqs": 32,
                                       "max_num_batched_tokens": 512, "max_model_len": section["max_model_len"],
                                       "kv_cache_memory_bytes": 2**26, "kv_cache_dtype": "auto"}
        assert [i["label"] for i in s["spec"]["instances"]] == ["first", "steady"]
        for item, v in zip(s["spec"]["instances"], (0, 1)):
            w = build_workload("shared-system-prompt", report["model"], SCALE, OUTPUT_LEN, variant=v)
            assert [r["prompt"] for r in item["workload"]["requests"]] == w.prompts
    assert report["vllm"] == {"python": fake[0].as_posix(), "threads": 1, "block_size": 32, "version": "0.0-fake"}


def test_a_quantized_kv_pool_reaches_both_systems_and_int8_is_refused_for_vllm(fake, model_dirs, tmp_path):
    """--kv-cache-dtype fp8 goes to vLLM's runner in its spec (kvserve's engine takes the same dict); vLLM's
    CPU build has no int8 pool, so asking for it beside a vLLM system is refused before anything runs."""
    python, _, tokens = fake
    seen = tmp_path / "seen.jsonl"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FAKE_SEEN", str(seen))
        mp.setenv("FAKE_TOKENS", str(tokens))
        quantized = bench(model_dirs["llama"], workloads=["shared-system-prompt"], systems=["vllm-cache"], scale=SCALE,
                          output_len=OUTPUT_LEN, max_num_seqs=32, max_num_batched_tokens=512, kv_cache_gib=0.0625,
                          kv_cache_dtype="fp8", vllm_python=str(python), vllm_threads=1, overhead_seqs=0,
                          progress=False)
        assert json.loads(seen.read_text().splitlines()[0])["spec"]["engine"]["kv_cache_dtype"] == "fp8"
        assert quantized["settings"]["kv_cache_dtype"] == "fp8"
        with pytest.raises(ValueError, match="vLLM's CPU build has no int8 KV cache"):
            bench(model_dirs["llama"], workloads=["shared-system-prompt"], systems=["kvserve-cache", "vllm-cache"],
                  kv_cache_dtype="int8", vllm_python=str(python), overhead_seqs=0, progress=False)


def test_runs_from_the_runner(report):
    runs = {r["name"]: r for r in report["workloads"]["shared-system-prompt"]["runs"]}
    assert list(runs) == ["kvserve-cache", "vllm-nocache", "vllm-cache"]
    for name in ("vllm-nocache", "vllm-cache"):
        run = runs[name]
        assert run["start_s"] == 30.0 and run["process"]["import_s"] == 5.0
        assert run["process"]["torch_threads"] == 1 and run["process"]["omp_num_threads"] == "1"
        assert run["steady_over_first"] == pytest.approx(2.0)
        assert run["output_tokens_per_s"] == pytest.approx(run["output_tokens"] / 1.0)
        assert run["ttft_s"]["p50"] == pytest.approx(0.1) and run["vllm_ttft_s"]["p50"] == 0.25
        assert run["itl_s"]["count"] == run["output_tokens"] - run["num_requests"]
    # the fake returns the engine's greedy tokens, computed in this process: the kvserve-cache runner's agree
    assert runs["vllm-cache"]["same_tokens_as_kvserve_cache"] == 1.0
    assert runs["vllm-cache"]["first"]["same_tokens_as_kvserve_cache"] == 1.0
    assert runs["vllm-nocache"]["first"]["same_tokens_as_kvserve_cache"] == 0.75  # one of four altered
    assert runs["vllm-nocache"]["same_tokens_as_kvserve_cache"] == 1.0


def test_targets_and_report_against_vllm(report):
    section = report["workloads"]["shared-system-prompt"]
    runs = {r["name"]: r for r in section["runs"]}
    ratio = runs["kvserve-cache"]["output_tokens_per_s"] / runs["vllm-cache"]["output_tokens_per_s"]
    targets = {t["name"]: t for t in section["targets"]}
    assert targets["kvserve-cache vs vllm-cache (x)"]["value"] == pytest.approx(ratio)
    assert targets["kvserve-cache vs vllm-cache (x)"]["target"] == 1.0
    assert targets["kvserve-cache vs vllm-cache (x, shared-prefix attention)"]["target"] == 1.3
    assert "kvserve-nocache vs vllm-nocache (x)" not in targets  # kvserve-nocache did not run
    (row,) = section["vs_vllm"]
    assert (row["kvserve"], row["vllm"], row["same_tokens_as_kvserve_cache"]) == ("kvserve-cache", "vllm-cache", 1.0)
    assert row["steady"]["ratio"] == pytest.approx(ratio) and row["vllm_start_s"] == 30.0
    assert row["first"]["vllm_tok_s"] == runs["vllm-cache"]["first"]["output_tokens_per_s"]
    md = format_markdown(report)
    assert "kvserve beside vLLM" in md and "vLLM 0.0-fake" in md and "OMP_NUM_THREADS=1" in md
    assert f"| kvserve-cache | vllm-cache | steady | {runs['kvserve-cache']['output_tokens_per_s']:.1f} " in md
    assert f"| {ratio:.2f}x |" in md
    assert "| vllm-nocache | 30.0 |" in md  # the instances table: start seconds
    assert ("vLLM start (LLM constructed, after import): vllm-nocache 30.0 s, vllm-cache 30.0 s; "
            "its torch threads: 1.") in md


def test_progress_and_failures(fake, model_dirs, monkeypatch, tmp_path):
    python, seen, tokens = fake
    monkeypatch.setenv("FAKE_SEEN", str(tmp_path / "seen.jsonl"))
    monkeypatch.setenv("FAKE_TOKENS", str(tokens))
    w = [(label, build_workload("shared-system-prompt", model_dirs["llama"], SCALE, OUTPUT_LEN, variant=v))
         for v, label in enumerate(("first", "steady"))]
    spec = make_spec("vllm-cache", model_dirs["llama"], 1, w, {"block_size": 32, "enable_prefix_caching": True})
    done = []
    result = run_spec(spec, runner_command("vllm-cache", str(python)), runner_env("vllm-cache", 1),
                      progress=done.append)
    assert done == [1] * 8 and result["wall_s"] > 0
    monkeypatch.setenv("FAKE_SLEEP", "60")
    with pytest.raises(RunnerError, match=r"vllm-cache .* was killed after 1 s"):
        run_spec(spec, runner_command("vllm-cache", str(python)), runner_env("vllm-cache", 1), timeout_s=1.0)
    monkeypatch.setenv("FAKE_SLEEP", "0")
    monkeypatch.setenv("FAKE_FAIL", "1")
    with pytest.raises(RunnerError, match=r"(?s)vllm-cache .* exited with 3.*a line of vLLM's log.*boom"):
        run_spec(spec, runner_command("vllm-cache", str(python)), runner_env("vllm-cache", 1))
    report = bench(model_dirs["llama"], workloads=["shared-system-prompt"], systems=["vllm-cache"], scale=SCALE,
                   output_len=OUTPUT_LEN, vllm_python=str(python), overhead_seqs=0, progress=False)
    section = report["workloads"]["shared-system-prompt"]
    assert section["runs"] == [] and [f["system"] for f in section["failed"]] == ["vllm-cache"]
    assert "boom" in section["failed"][0]["error"] and "**vllm-cache failed**: boom" in format_markdown(report)
    with pytest.raises(ValueError, match="vllm-python"):
        bench(model_dirs["llama"], workloads=["shared-system-prompt"], systems=["vllm-cache"], progress=False)
    with pytest.raises(ValueError, match="not an executable file"):
        bench(model_dirs["llama"], workloads=["shared-system-prompt"], systems=["vllm-cache"], progress=False,
              vllm_python=str(tmp_path / "missing"))


def test_real_runner_predecessors_match_the_workloads(model_dirs):
    w = build_workload("multi-turn", model_dirs["llama"], 0.125, 4)
    assert vllm_runner._predecessors(w.to_dict()["requests"]) == w.predecessor() != {}


@pytest.mark.parametrize("script", ["vllm_runner.py", "vllm_bench_client.py"])
def test_vllm_side_scripts_import_only_stdlib_and_vllm(script):
    tree = ast.parse((Path(VLLM_RUNNER).parent / script).read_text())
    modules = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
               for alias in node.names}
    modules |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert modules - set(sys.stdlib_module_names) - {"__future__"} == {"vllm"}


def test_runner_env_keeps_this_repository_away_from_vllm(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO_ROOT), "/elsewhere"]))
    assert runner_env("vllm-cache", 3)["PYTHONPATH"] == "/elsewhere"
    assert runner_env("kvserve-cache", 3)["PYTHONPATH"].split(os.pathsep)[0] == str(REPO_ROOT)
    assert runner_env("kvserve-cache", 3)["OMP_NUM_THREADS"] == "3"


def test_repeat_takes_turns_and_keeps_each_systems_best_round(fake, model_dirs, monkeypatch, tmp_path):
    python, _, tokens = fake
    monkeypatch.setenv("FAKE_SEEN", str(tmp_path / "seen.jsonl"))
    monkeypatch.setenv("FAKE_TOKENS", str(tokens))
    monkeypatch.setenv("FAKE_ROUNDS", str(tmp_path / "count"))
    report = bench(model_dirs["llama"], workloads=["shared-system-prompt"], systems=["vllm-nocache", "vllm-cache"],
                   scale=SCALE, output_len=OUTPUT_LEN, vllm_python=str(python), overhead_seqs=0, progress=False,
                   repeat=2)
    seen = [json.loads(line)["spec"]["system"] for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    assert seen == ["vllm-nocache", "vllm-cache", "vllm-nocache", "vllm-cache"]  # turns, not blocks
    runs = {r["name"]: r for r in report["workloads"]["shared-system-prompt"]["runs"]}
    # nocache ran 1st and 3rd (slow steady both times), cache 2nd and 4th (fast both times)
    for name, steady in (("vllm-nocache", 1.0), ("vllm-cache", 0.5)):
        rounds = runs[name]["rounds"]
        assert len(rounds) == 2 and rounds[0]["pid"] != rounds[1]["pid"]
        assert runs[name]["output_tokens_per_s"] == max(r["steady"] for r in rounds)
    assert runs["vllm-cache"]["output_tokens_per_s"] > 1.5 * runs["vllm-nocache"]["output_tokens_per_s"]
    md = format_markdown(report)
    assert "2 rounds, the systems taking turns" in md and "rounds (first / steady)" in md
