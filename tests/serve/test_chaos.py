"""`kvserve chaos` and `kvserve soak`, smoke-sized: the commands as a user runs them (a local Ray with
this machine's CPUs), one fault, a few seconds of soak, their JSON reports checked."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def kvserve(*args: str, timeout: float) -> None:
    """Run ``kvserve *args`` with a Ray temp directory of its own (its cluster's logs apart from the
    other test worker's clusters); on failure the message ends with its GCS's and raylet's last log
    lines, where Ray's own failures show."""
    ray_tmp = tempfile.mkdtemp(prefix="kvc-", dir="/tmp")  # short: Ray's socket paths live under it
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT), "RAY_TMPDIR": ray_tmp}
    env.pop("RAY_ADDRESS", None)
    try:
        result = subprocess.run([sys.executable, "-m", "cluster.cli", *args], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=timeout)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:] + ray_log_tails(ray_tmp)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def ray_log_tails(ray_tmp: str, lines: int = 15) -> str:
    tails = []
    for log in sorted(Path(ray_tmp).glob("ray/session_*/logs/*")):
        if log.name.startswith(("gcs_server", "raylet")) and log.suffix in (".out", ".err") and log.is_file():
            text = log.read_text(errors="replace").splitlines()[-lines:]
            tails.append(f"\n--- {log.name} ---\n" + "\n".join(text))
    return "".join(tails)


def test_soak_reports_every_process_errors_and_blocks(model_dirs, tmp_path):
    out = tmp_path / "soak.json"
    kvserve("soak", "--model", model_dirs["llama"], "--minutes", "0.1", "--warmup", "3", "--concurrency", "2",
            "--max-tokens", "4", "--app-arg", "num_kv_blocks=256", "--out", str(out), timeout=300)
    report = json.loads(out.read_text())
    assert report["requests"] > 0 and report["requests_ok"] == report["requests"]
    assert report["errors"] == 0 and report["outcomes"] == {"ok": report["requests"]}
    # the mixed load (the default): every kind ran, the streams cut after their first chunk included
    assert report["load"] == "mixed" and set(report["ok_by_kind"]) == {
        "completion", "completion_stream", "chat", "chat_stream", "completion_stream_cut"}
    assert sum(report["ok_by_kind"].values()) == report["requests"]
    assert report["num_blocks_in_use_at_end"] == 0 and report["num_requests_running_at_end"] == 0
    names = {p["name"] for p in report["processes"]}
    assert {"ray::SchedulerActor", "ray::ServeReplica:kvserve:LLMServer", "ray::ServeReplica:kvserve:Ingress",
            "ray::ServeController", "ray::ProxyActor", "raylet", "gcs_server"} <= names
    for p in report["processes"]:
        assert p["rss_start_mb"] > 0  # each figure is rounded to 0.1 MB on its own
        assert abs(p["growth_mb"] - (p["rss_end_mb"] - p["rss_start_mb"])) <= 0.1 + 1e-9
        # RSS every 30 s (one interval in a 6 s run): from the baseline to the end figure
        assert p["rss_timeline_mb"] == [[0, p["rss_start_mb"]], [6, p["rss_end_mb"]]]
    assert report["max_growth_mb"] == max(p["growth_mb"] for p in report["processes"])
    # the pool's first fill, reported: blocks made only grow, within the pool (255 usable of 256)
    assert 0 < report["num_blocks_made_start"] <= report["num_blocks_made_end"] <= 255


def test_chaos_the_scheduler_actor_then_a_rank_killed_at_tp2(model_dirs, tmp_path):
    """One app at TP 2, two faults in turn (one start of the cluster and app for both).

    The scheduler actor killed: the requests in flight on it, and those refused while its replica
    rebuilds it, read the API's sentences: no ActorDiedError, actor id, pid or address.

    Then a rank of the rebuilt engine killed: the ranks are rebuilt under the same scheduler, the
    requests in flight are recomputed, the ones that arrive meanwhile wait, and none fails or hangs;
    the run ends with no block in use (the rank fault last, so that its recovery is what that checks)."""
    out = tmp_path / "chaos.json"
    kvserve("chaos", "--model", model_dirs["llama"], "--faults", "scheduler", "rank", "--tensor-parallel-size", "2",
            "--concurrency", "2", "--max-tokens", "256", "--timeout", "120", "--settle", "2", "--app-arg", "num_kv_blocks=256",
            "--out", str(out), timeout=500)
    report = json.loads(out.read_text())
    scheduler, rank = report["faults"]

    assert rank["fault"] == "rank" and rank["killed"].startswith("rank 1 (pid ")
    assert rank["in_flight"] == 2  # both clients had a request open
    assert rank["lost"] == 0 and rank["in_flight_outcomes"] == {"ok": 2}
    assert rank["refused"] == 0 and rank["hung"] == 0 and rank["leaked"] == []
    assert rank["recovery_s"] is not None and 0 < rank["recovery_s"] < 60

    assert scheduler["fault"] == "scheduler" and scheduler["in_flight"] == 2
    assert scheduler["lost"] == 2 and scheduler["hung"] == 0  # both failed, with an answer
    assert sum(scheduler["error_messages"].values()) >= 2 and scheduler["leaked"] == []
    # a request streaming when the actor died reads the first; one the replica was admitting, the second
    stopped = {"the engine stopped while serving this request; retry shortly", "the engine stopped; retry shortly"}
    assert stopped & set(scheduler["error_messages"]), scheduler["error_messages"]
    # one arriving while the replica rebuilds the actor (which the replica's own admission may see first)
    assert set(scheduler["error_messages"]) <= stopped | {
        "no engine replica is serving yet (starting, restarting or waiting for resources); retry shortly",
        "the engine is restarting; retry shortly"}
    assert scheduler["recovery_s"] is not None
    assert report["num_blocks_in_use_at_end"] == 0 and report["num_requests_running_at_end"] == 0
