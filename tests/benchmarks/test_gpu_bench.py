"""`kvserve bench-gpu` at smoke size on CPU (the Triton backend under its interpreter): every part of the
report is produced, the two backends agree, the bandwidth bound counts the bytes a decode reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import gpu_bench
from engine.config import ModelConfig
from workers.model_builder import num_parameters

ROOT = Path(__file__).resolve().parents[2]


def test_bench_gpu_smoke_on_cpu(model_dirs, tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "bench-gpu", "--model", model_dirs["llama"], "--device", "cpu",
         "--batches", "1", "3", "--prompt-len", "24", "--decode-steps", "3", "--prefill-prompts", "1",
         "--prefill-len", "32", "--shared-requests", "4", "--new-tokens", "4", "--hf-batch", "2",
         "--agreement-prompts", "1", "--agreement-len", "3", "--out", str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dtype"] == "float32" and report["copy_bandwidth_gb_s"] > 0
    for backend in ("torch", "triton"):
        decode = report["backends"][backend]["decode"]
        assert [d["batch"] for d in decode] == [1, 3]
        for d in decode:
            assert d["step_ms"] > 0 and abs(d["x_bound"] - d["step_ms"] / d["bound_ms"]) < 1e-9 * d["x_bound"]
            assert abs(d["tokens_per_s"] - d["batch"] / (d["step_ms"] / 1000)) < 1e-6 * d["tokens_per_s"]
        assert report["backends"][backend]["prefill_tokens_per_s"] > 0
    assert set(report["shared_system_prompt_output_tokens_per_s"]) == {"cache", "nocache"}
    assert report["hf_generate_output_tokens_per_s"] > 0
    agreement = report["agreement"]
    assert (agreement["reference"], agreement["other"], agreement["positions"]) == ("torch", "triton", 3)
    assert agreement["agreeing"] == 3  # float32, the same model: the backends pick the same tokens
    assert "triton vs torch: 3/3 greedy positions agree" in proc.stdout
    assert report["cuda_graphs"] == {"status": "not run: they need CUDA and the triton backend"}
    assert report["thresholds"]["min_graph_agreement"] == 0.99 and report["thresholds"]["max_graph_logit_diff"] is None
    assert "CUDA graphs: not run: they need CUDA and the triton backend" in proc.stdout


def test_the_bound_counts_every_weight_a_decode_reads(model_dirs):
    """With no KV and no batch, the bytes are the checkpoint's parameters minus the embedding table (a
    decode reads only its batch's rows of it), the LM head read whole."""
    for arch in ("llama", "qwen2"):
        hf_config = ModelConfig.from_dir(model_dirs[arch]).hf_config
        embedding = hf_config["vocab_size"] * hf_config["hidden_size"]
        tied = hf_config.get("tie_word_embeddings", False)
        expected = num_parameters(model_dirs[arch]) - (0 if tied else embedding)
        assert gpu_bench.decode_bytes(hf_config, 1, batch=0, context=0) == expected
        kv_per_token = hf_config["num_hidden_layers"] * 2 * hf_config["num_key_value_heads"] * \
            (hf_config["hidden_size"] // hf_config["num_attention_heads"])
        assert gpu_bench.decode_bytes(hf_config, 2, batch=3, context=10) == \
            2 * (expected + 3 * hf_config["hidden_size"] + 3 * 10 * kv_per_token)


def test_backends_that_disagree_fail_the_command(monkeypatch, tmp_path, capsys):
    report = {"device": "cpu", "dtype": "float32", "copy_bandwidth_gb_s": 1.0, "backends": {},
              "shared_system_prompt_output_tokens_per_s": {"cache": 1.0, "nocache": 1.0},
              "agreement": {"reference": "torch", "other": "triton", "positions": 100, "agreeing": 98,
                            "agreement": 0.98},
              "cuda_graphs": {"status": "captured", "sizes": [1, 2], "decode": [
                  {"batch": 1, "step_ms": 2.0, "bound_ms": 1.0, "x_bound": 2.0, "tokens_per_s": 500.0,
                   "x_eager": 3.0}],
                  "agreement": {"steps": 20, "positions": 100, "agreeing": 100, "identical_logits": 40,
                                "max_logit_diff": 0.25, "max_abs_logit": 30.0, "agreement": 1.0}},
              "elapsed_s": 1.0}
    monkeypatch.setattr(gpu_bench, "bench_gpu", lambda args: report)
    args = type("Args", (), {"out": str(tmp_path / "r.json"), "min_agreement": 0.99, "min_graph_agreement": 0.95,
                             "max_graph_logit_diff": None})()
    assert gpu_bench.run_bench_gpu(args) == 1
    captured = capsys.readouterr()
    assert "the backends agree on 98.0% of greedy positions, below 99%" in captured.err
    assert "  batch    1: step     2.00 ms (2.00x the bound, 3.00x faster than eager)" in captured.out
    assert ("  graph replays vs eager steps: 100/100 decode positions agree (100.0%) over 20 steps, 40 with "
            "identical logits; largest logit difference 0.25 (logits up to 30)") in captured.out
    assert json.loads((tmp_path / "r.json").read_text())["agreement"]["agreeing"] == 98
    args.min_agreement = 0.95
    assert gpu_bench.run_bench_gpu(args) == 0
    args.max_graph_logit_diff = 0.1  # a logit bound, once measured, is checked too
    assert gpu_bench.run_bench_gpu(args) == 1
    assert "logits differ from the eager step's by 0.25, more than 0.1" in capsys.readouterr().err
    args.max_graph_logit_diff = None
    report["cuda_graphs"]["agreement"].update(agreeing=90, agreement=0.9)  # graphs that change tokens fail it
    assert gpu_bench.run_bench_gpu(args) == 1
    assert "CUDA graph replays and eager steps agree on 90.0% of greedy positions, below 95%" in capsys.readouterr().err


def test_the_device_script_reports_a_machine_without_cuda_and_fails(tmp_path):
    """benchmarks/gpu_check.sh (the one prepared run for a GPU machine): on this CPU the kernel tests fail at
    their first check, the script says so in its summary with the part's time and exits 1; its logs land
    in $OUT; its default limits leave 10 minutes of device time room for the start."""
    import re

    script = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    limits = [int(n) for n in re.findall(r"\$\{(?:KERNELS|TESTS|BENCH)_TIMEOUT:-(\d+)\}", script)]
    assert len(limits) == 3 and sum(limits) <= 540, limits
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "PARTS": "kernels"})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = (tmp_path / "device.txt").read_text().splitlines()
    assert summary[1] == "device none: these checks need CUDA"
    assert re.fullmatch(r"gpu kernels: exit 1 in \d+ s \(limit 140 s\)", summary[2]), summary
    assert re.fullmatch(r"total: \d+ s", summary[3]) and len(summary) == 4
    assert "the gpu tests need a CUDA device" in (tmp_path / "gpu_kernels.log").read_text()
    assert not (tmp_path / "gpu_tests.log").exists() and not (tmp_path / "gpu.json").exists()  # PARTS=kernels
