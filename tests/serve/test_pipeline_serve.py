"""`serve run` of the shipped config at pipeline_parallel_size 2 on a Ray cluster of two nodes started
on this machine (`ray start`, each node its own temp directory and ports) whose memory holds one rank
each: the stages' ranks on different nodes (placed there by the memory each rank's bundle reserves),
and the openai client's greedy completion equal to the offline engine's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

import openai

from cluster.memory_plan import bundle_memory
from cluster.serve_env import NODE_ENV
from engine import LLM, SamplingParams, engine_config
from tests.serve.serve_harness import free_port, wait_for
from tests.serve.test_serve_cli import RAY, ROOT, SERVE, completes, config_for, env, stop_cluster

RANK_NODES = """
import json, ray
ray.init(address="{address}", log_to_driver=False)
[name] = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("engine:")]
engine = ray.get_actor(name, namespace="kvserve")
print(json.dumps(ray.get(engine.stats.remote(), timeout=60)["worker_nodes"]))
"""


def start_node(temp_dir: str, *args: str) -> None:
    result = subprocess.run([RAY, "start", f"--temp-dir={temp_dir}", "--num-cpus=2", "--disable-usage-stats",
                             f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}",
                             *args], cwd=ROOT, env={**NODE_ENV, **env()}, capture_output=True, text=True,
                            timeout=180)  # the node tolerances serve_env gives a local cluster (docs/serving.md)
    assert result.returncode == 0, result.stderr[-2000:]


def test_serve_run_at_pp2_across_two_nodes_answers_the_openai_client(model_dirs, tmp_path):
    model = model_dirs["llama"]
    # each node's memory holds one rank's reservation and not two (by CPUs one node would take both)
    node_memory = int(1.5 * bundle_memory(engine_config(model, pipeline_parallel_size=2, num_kv_blocks=256),
                                          use_gpu=False))
    prompt = "The quick brown fox"
    with LLM(model=model, num_kv_blocks=256) as llm:
        expected = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    # a bundle per rank and none beside them (proxy_cpus 0: the replica and scheduler actor share rank 0's);
    # PACK would put both on one node but for their memory
    path, base_url = config_for(model, tmp_path, pipeline_parallel_size=2, placement_strategy="PACK", proxy_cpus=0)
    path.write_text(path.read_text().replace("proxy_location: EveryNode", "proxy_location: HeadOnly"))
    head_dir = tempfile.mkdtemp(prefix="kvpp", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    node_dir = tempfile.mkdtemp(prefix="kvpp", dir="/tmp")
    port = free_port()
    address = f"127.0.0.1:{port}"
    proc = None
    try:
        start_node(head_dir, "--head", f"--port={port}", "--include-dashboard=false", f"--memory={node_memory}")
        start_node(node_dir, f"--address={address}", f"--memory={node_memory}")
        with open(tmp_path / "serve_run.log", "wb") as log:  # (the child keeps its own descriptor)
            proc = subprocess.Popen([SERVE, "run", str(path)], cwd=ROOT, env={**env(), "RAY_ADDRESS": address},
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

        def serve_run_log() -> str:
            return (tmp_path / "serve_run.log").read_text(errors="replace")[-3000:]

        try:
            wait_for(lambda: proc.poll() is not None or completes(base_url), timeout_s=240, interval_s=1)
        except Exception as exc:
            raise AssertionError(f"serve run did not answer: {serve_run_log()}") from exc
        assert proc.poll() is None, f"serve run exited: {serve_run_log()}"
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        completion = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0.0,
                                               extra_body={"ignore_eos": True})
        assert completion.choices[0].text == expected.outputs[0].text
        assert completion.usage.completion_tokens == 8
        nodes = json.loads(subprocess.run([sys.executable, "-c", RANK_NODES.format(address=address)], cwd=ROOT,
                                          env=env(), capture_output=True, text=True, timeout=120,
                                          check=True).stdout.strip().splitlines()[-1])
        assert len(nodes) == 2 and nodes[0] != nodes[1], nodes  # rank 0 (stage 0) and rank 1 (stage 1)
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # `serve run` in the background ignores SIGINT
            proc.wait(timeout=60)
        stop_cluster(node_dir)
        stop_cluster(head_dir, gcs_port=port)
