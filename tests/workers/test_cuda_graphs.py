"""CUDA graphs' set-up on the CPU side: the batch-size buckets, why a runner runs eagerly, and a
capture that fails leaving an engine that serves eagerly (the buckets themselves are exercised under
the Triton interpreter in tests/kernels/triton/test_triton_graphs.py, captured in tests/gpu)."""

from __future__ import annotations

import logging

import pytest

from engine import LLM, SamplingParams
from workers.cuda_graphs import DecodeGraphs, graph_batch_sizes


@pytest.mark.parametrize("max_num_seqs,sizes", [
    (1, [1]),
    (3, [1, 2, 3]),
    (4, [1, 2, 4]),
    (20, [1, 2, 4, 8, 16, 20]),
    (256, [1, 2, 4] + list(range(8, 257, 8))),
    (1000, [1, 2, 4] + list(range(8, 513, 8))),
])
def test_buckets_cover_every_decode_batch_up_to_the_cap(max_num_seqs, sizes):
    assert graph_batch_sizes(max_num_seqs) == sizes


def test_a_cpu_runner_runs_eagerly_and_says_why(model_dirs):
    with LLM(model=model_dirs["llama"], num_kv_blocks=32, max_model_len=64, attention_backend="torch") as llm:
        runner = llm.core.executor.worker.runner
        assert llm.config.enforce_eager  # the default until the capture has run on a GPU
        assert runner.graphs_unavailable() == "enforce_eager=True"
        assert runner.graphs is None and llm.stats()["cuda_graph_sizes"] == []
    with LLM(model=model_dirs["llama"], num_kv_blocks=32, max_model_len=64, attention_backend="torch",
             enforce_eager=False) as llm:
        runner = llm.core.executor.worker.runner
        assert runner.graphs_unavailable() == "they need a CUDA device, not cpu"
        assert not runner.capture_graphs() and runner.graphs is None
        runner.device = runner.device.__class__("cuda")  # as a CUDA runner on the torch backend sees it
        assert runner.graphs_unavailable() == ("the torch attention backend cannot be captured "
                                               "(attention_backend='triton' can)")


def test_a_failed_capture_is_a_warning_and_the_engine_serves_eagerly(model_dirs, monkeypatch, caplog):
    def fail(self):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(DecodeGraphs, "capture", fail)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = [{"prompt_token_ids": [1, 5, 9, 13, 17]}]
    with LLM(model=model_dirs["llama"], num_kv_blocks=32, max_model_len=64, attention_backend="torch") as llm:
        runner = llm.core.executor.worker.runner
        with caplog.at_level(logging.WARNING, logger="workers.model_runner"):
            assert runner.capture_graphs(capture=False, sizes=[1, 2]) is False
        assert runner.graphs is None
        assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
            "CUDA graph capture failed (RuntimeError: operation not permitted when stream is capturing): "
            "every step runs eagerly"]
        out = llm.generate(prompt, params)[0].outputs[0].token_ids
    with LLM(model=model_dirs["llama"], num_kv_blocks=32, max_model_len=64, attention_backend="torch") as llm:
        assert llm.generate(prompt, params)[0].outputs[0].token_ids == out
