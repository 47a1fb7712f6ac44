"""`kvserve bench-online-vllm` without vLLM: a fake vLLM python plays the OpenAI server (answering
/v1/models, leaving a detached process behind as a Ray cluster would) and the benchmark client (writing
a result file); kvserve is started for real with `serve run` on a free port. Checked: readiness,
the client's flags, the table, CPU accounting, and that SIGTERM plus the clean-up leave nothing running."""

from __future__ import annotations

import argparse
import json
import os
import sys
import types

import pytest

from benchmarks import online_vllm, server_process
from benchmarks.online_vllm import add_bench_online_vllm_arguments, bench_online_vllm, format_online_report
from cluster.serve_env import free_port

FAKE_VLLM = """\
#!{python}
import http.server, json, os, subprocess, sys, time, urllib.request
args = sys.argv[1:]
def flag(name):
    return args[args.index(name) + 1]
if args[:2] == ["-m", "vllm.entrypoints.openai.api_server"]:
    # what a server may leave behind: a process in a session of its own, reparented when the server exits
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    name = flag("--served-model-name")
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({{"data": [{{"id": name}}]}}).encode()
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    time.sleep(1.0)  # not answering at once
    http.server.HTTPServer(("127.0.0.1", int(flag("--port"))), Handler).serve_forever()
else:  # benchmarks/vllm_bench_client.py <flags>
    base = flag("--base-url")
    models = json.load(urllib.request.urlopen(base + "/v1/models"))
    assert models["data"][0]["id"] == flag("--served-model-name"), models
    if base.endswith(os.environ.get("FAKE_COMPLETE_PORT", "-")):  # a real server: one real completion
        body = json.dumps({{"model": flag("--served-model-name"), "prompt": "Hello", "max_tokens": 4,
                           "temperature": 0, "ignore_eos": True}}).encode()
        request = urllib.request.Request(base + "/v1/completions", body, {{"Content-Type": "application/json"}})
        choice = json.load(urllib.request.urlopen(request))["choices"][0]
        assert choice["finish_reason"] == "length", choice
    n = int(flag("--num-prompts"))
    result = {{"completed": n, "failed": 0, "output_throughput": 100.0 if "8001" in base else 50.0,
              "request_throughput": 3.0, "p50_ttft_ms": 20.0, "p99_ttft_ms": 40.0, "p50_tpot_ms": 5.0,
              "p50_itl_ms": 5.0, "p50_e2el_ms": 200.0, "argv": args}}
    json.dump(result, open(os.path.join(flag("--result-dir"), flag("--result-filename")), "w"))
"""


def cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:  # gone meanwhile
        return b""


@pytest.fixture()
def fake_python(tmp_path):
    python = tmp_path / "python"
    python.write_text(FAKE_VLLM.format(python=sys.executable))
    python.chmod(0o755)
    return str(python)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_online_vllm_arguments(parser)
    return parser.parse_args(list(argv))


def test_client_flags(fake_python):
    args = parse("--vllm-python", fake_python, "--num-prompts", "16")
    command = online_vllm.client_command(args, "/m", "http://127.0.0.1:8000", "/r", "x.json")
    pairs = dict(zip(command[2::1], command[3::1]))
    assert command[:2] == [fake_python, str(online_vllm.CLIENT)]
    for flag, value in {"--backend": "openai", "--dataset-name": "random", "--random-prefix-len": "512",
                        "--random-input-len": "32", "--random-output-len": "32", "--num-prompts": "16",
                        "--max-concurrency": "48", "--base-url": "http://127.0.0.1:8000", "--tokenizer": "/m",
                        "--served-model-name": "bench", "--temperature": "0", "--result-filename": "x.json"}.items():
        assert pairs[flag] == value
    assert "--ignore-eos" in command and "--save-result" in command
    command = online_vllm.client_command(args, "/m", "http://127.0.0.1:8000", "/r", "x.json", "no-prefix", 16)
    pairs = dict(zip(command[2::1], command[3::1]))
    assert (pairs["--random-prefix-len"], pairs["--random-input-len"], pairs["--max-concurrency"]) == ("0", "544", "16")
    # each workload its own prompts, the same for both servers: no workload finds another's in the cache
    commands = [online_vllm.client_command(args, "/m", "u", "/r", "x.json", d, c) for d, c in online_vllm.workloads(args)]
    seeds = [dict(zip(c[2:], c[3:]))["--seed"] for c in commands]
    assert len(set(seeds)) == 4
    assert pairs["--seed"] == str(online_vllm.workload_seed("no-prefix", 16))
    assert online_vllm.workloads(args) == [("shared-prefix", 16), ("shared-prefix", 48), ("no-prefix", 16),
                                           ("no-prefix", 48)]


def test_untuned_servers_get_nothing_but_the_shared_batch_limits(fake_python, monkeypatch, tmp_path):
    """Untuned (the default) each server starts with its own defaults; --tuned passes the settings."""
    launched = {}
    monkeypatch.setattr(server_process, "launch", lambda name, command, env, *a: launched.update(
        {name: (command, env)}) or types.SimpleNamespace(extra={}))
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    args = parse("--vllm-python", fake_python, "--kvserve-port", "8000")
    online_vllm.start_kvserve(args, "/m", str(tmp_path))
    online_vllm.start_vllm(args, "/m", str(tmp_path))
    kv_command, _ = launched["kvserve"]
    assert kv_command[1:] == ["run", "serve_app:app", "model=/m", "served_model_name=bench"]
    vllm_command, vllm_env = launched["vllm"]
    assert "--block-size" not in vllm_command
    assert vllm_command[vllm_command.index("--kv-cache-memory-bytes") + 1] == str(2 << 30)  # kvserve's CPU default
    assert "OMP_NUM_THREADS" not in vllm_env  # vLLM chooses its threads
    assert vllm_command[vllm_command.index("--max-num-seqs") + 1] == "256"
    args = parse("--vllm-python", fake_python, "--kvserve-port", "8000", "--tuned", "--threads", "2")
    online_vllm.start_kvserve(args, "/m", str(tmp_path))
    online_vllm.start_vllm(args, "/m", str(tmp_path))
    assert "torch_threads=2" in launched["kvserve"][0] and "block_size=8" in launched["kvserve"][0]
    assert launched["vllm"][1]["OMP_NUM_THREADS"] == "2" and "--block-size" in launched["vllm"][0]


def test_fake_vllm_server_started_measured_and_stopped(fake_python, model_dirs, monkeypatch, tmp_path):
    monkeypatch.setattr(server_process, "LINGER_S", 2.0)
    port = free_port()
    args = parse("--vllm-python", fake_python, "--systems", "vllm", "--vllm-port", str(port), "--num-prompts", "16",
                 "--tuned", "--vllm-threads", "1", "--startup-timeout", "60", "--rounds", "1", "--concurrency", "4")
    report = bench_online_vllm(args, model_dirs["llama"], str(tmp_path))
    [section] = report["starts"]
    assert list(section["workloads"]) == ["shared-prefix c4", "no-prefix c4"]
    assert section["first_workload"] == "shared-prefix c4"
    run = section["workloads"]["no-prefix c4"]
    assert run["result"]["completed"] == 16 and section["ready_s"] >= 1.0
    assert "--enable-prefix-caching" not in run["result"]["argv"]  # the client's flags, not the server's
    assert run["result"]["argv"][run["result"]["argv"].index("--random-prefix-len") + 1] == "0"
    assert any("sleep(600)" in k for k in section["killed_after_sigterm"])  # the left-behind process, killed
    assert section["left_running"] == []
    assert server_process.port_free(port)
    with open(section["log"]) as f:
        assert f.read() == ""  # the fake server prints nothing
    assert report["settings"]["vllm_threads"] == 1 and report["settings"]["vllm_block_size"] == 32
    table = format_online_report(report)
    assert "| output tok/s | - | 50.0 | - |" in table and "| completed requests | - | 16 | - |" in table
    assert "### no-prefix c4" in table and "tuned: threads=2, vllm_threads=1" in table


def test_kvserve_serve_run_started_measured_and_stopped(fake_python, model_dirs, monkeypatch, tmp_path):
    """The real `serve run` (on a free port, hence through a config file), answered by a completion,
    then SIGTERM: no process of its Ray cluster may survive."""
    port = free_port()
    monkeypatch.setenv("FAKE_COMPLETE_PORT", str(port))
    args = parse("--vllm-python", fake_python, "--systems", "kvserve", "--kvserve-port", str(port),
                 "--num-prompts", "8", "--tuned", "--kv-cache-gib", "0.0625", "--startup-timeout", "120",
                 "--rounds", "1", "--datasets", "shared-prefix", "--concurrency", "8")
    report = bench_online_vllm(args, model_dirs["llama"], str(tmp_path))
    [section] = report["starts"]
    run = section["workloads"]["shared-prefix c8"]
    assert run["result"]["completed"] == 8
    assert section["left_running"] == []
    assert server_process.port_free(port)
    assert any(name.startswith("ray::") for name in run["server_cpu_s"]), run["server_cpu_s"]
    assert run["server_cpu_s_total"] > 0
    config = json.load(open(os.path.join(report["logs"], "kvserve_serve_config.yaml")))
    assert config["http_options"]["port"] == port
    assert config["applications"][0]["args"]["model"] == model_dirs["llama"]
    leftovers = [pid for pid in server_process.all_pids() if section["ray_tmpdir"].encode() in cmdline(pid)]
    assert leftovers == [] and not os.path.exists(section["ray_tmpdir"])  # its session files removed too


def test_table_ratios_best_of_rounds_and_first_workload():
    def run(tok_s, ttft):
        return {"result": {"output_throughput": tok_s, "request_throughput": tok_s / 32, "p50_ttft_ms": ttft,
                           "completed": 96, "failed": 0},
                "client_wall_s": 20.0, "server_cpu_s": {"ray::SchedulerActor": 20.5},
                "server_cpu_s_total": 30.0, "client_cpu_s": 4.0}

    def start(system, round_, tok_s, ttft):
        return {"system": system, "round": round_, "ready_s": 10.0, "first_workload": "shared-prefix c48",
                "workloads": {"shared-prefix c48": run(tok_s, ttft)}}
    report = {"model": "/m", "settings": {"num_prompts": 96, "prefix_len": 512, "input_len": 32, "output_len": 32,
                                          "max_num_seqs": 256, "max_num_batched_tokens": 2048, "tuned": False,
                                          "rounds": 2},
              "starts": [start("kvserve", 1, 150.0, 500.0), start("vllm", 1, 400.0, 150.0),
                         start("vllm", 2, 380.0, 140.0), start("kvserve", 2, 200.0, 300.0)]}
    table = format_online_report(report)
    assert "| output tok/s | 200.0 | 400.0 | 0.50x |" in table  # each system's best round
    assert "| TTFT p50 (ms) | 300.0 | 150.0 | 2.00x |" in table  # from the same run as its throughput
    assert "| completed requests | 96 | 96 | 1.00x |" in table
    assert "ray::SchedulerActor 20.5" in table and "untuned: both servers' defaults" in table
    assert "- round 1 kvserve: answered 10.0 s after launch; shared-prefix c48: 150.0 output tok/s" in table
