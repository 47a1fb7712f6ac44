"""What the CUDA start-up profile must see before the KV pool takes the rest of the device: the
costliest prefill attention (a chunk of ``max_num_batched_tokens`` after a cached prefix that fills
``max_model_len``), and the CUDA graphs' memory (captured once over a throwaway pool, taken off the
budget; the real capture held to it). torch.cuda's memory and graph calls are stood in for on CPU, so
what is profiled and the arithmetic are checked here; the figures themselves come from a GPU run."""

from __future__ import annotations

import contextlib
import logging
import types

import pytest
import torch
import torch.nn.functional as F

import kernels.torch_attention as torch_attention
from engine import LLM, SamplingParams
from tests.workers.test_memory_profile import FakeCuda
from workers.cuda_graphs import graph_batch_sizes, graph_memory_reserve

GiB, MiB = 2**30, 2**20


def _spy_forwards(runner, seen):
    forward = runner.model.forward

    def spy(input_ids, positions, kv_caches, meta):
        seen.append((list(meta.query_lens), list(meta.context_lens), positions[0].item(), positions[-1].item(),
                     kv_caches[0][0].shape[0]))
        return forward(input_ids, positions, kv_caches, meta)

    runner.model.forward = spy
    return forward


def _spy_prefill_kv(monkeypatch, seen):
    """Bytes of the K and V each prefill SDPA call of the torch backend attends over."""

    def spy(query, key, value, **kwargs):
        if query.shape[2] > 1:  # a prefill chunk (decodes fold their heads: one query row each)
            seen.append(key.numel() * key.element_size() + value.numel() * value.element_size())
        return F.scaled_dot_product_attention(query, key, value, **kwargs)

    monkeypatch.setattr(torch_attention, "F", types.SimpleNamespace(scaled_dot_product_attention=spy))


@pytest.mark.parametrize("max_num_batched_tokens,chunk,prefix", [(64, 64, 192), (512, 256, 0)])
def test_the_profile_prefills_the_largest_chunk_after_the_longest_cached_prefix(model_dirs, monkeypatch,
                                                                                 max_num_batched_tokens, chunk,
                                                                                 prefix):
    """With the CUDA calls stood in for: the profile's prefill is the last chunk of a ``max_model_len``
    sequence (no prefix where one chunk holds ``max_model_len``), over a pool of that sequence's blocks."""
    with LLM(model_dirs["llama"], max_num_seqs=4, max_model_len=256, max_num_batched_tokens=max_num_batched_tokens,
             num_kv_blocks=40, attention_backend="torch") as llm:
        worker = llm.core.executor.worker
        FakeCuda(worker.runner, free_after=70 * GiB, peak=5 * GiB, reserved=6 * GiB).install(monkeypatch)
        worker.device, worker._memory_at_start = torch.device("cuda", 0), (78 * GiB, 80 * GiB)
        seen = []
        forward = _spy_forwards(worker.runner, seen)
        try:
            worker.determine_num_kv_blocks()
        finally:
            worker.runner.model.forward, worker.device = forward, torch.device("cpu")
        prefill, decode = seen
        assert prefill == ([chunk], [256], prefix, 255, 256 // 16 + 1)
        assert decode == ([1] * 4, [256] * 4, 255, 255, 256 // 16 + 1)


def test_the_profile_attends_over_at_least_the_kv_of_any_prefill_the_engine_runs(model_dirs, monkeypatch):
    """The torch backend's prefill transient (the K/V it gathers and repeats) in the profile bounds
    what serving a long prompt in chunks and a prefix-cache hit take."""
    with LLM(model_dirs["llama"], max_num_seqs=4, max_model_len=256, max_num_batched_tokens=64, num_kv_blocks=40,
             attention_backend="torch") as llm:
        runner = llm.core.executor.worker.runner
        profiled, served = [], []
        _spy_prefill_kv(monkeypatch, profiled)
        runner.profile_run()
        _spy_prefill_kv(monkeypatch, served)
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        prompt = [(7 * i) % 200 + 3 for i in range(250)]
        llm.generate([{"prompt_token_ids": prompt[:200]}], params)  # 64, 64, 64, 8: chunks after prefixes
        hits = llm.stats()["prefix_cache_hits"]
        llm.generate([{"prompt_token_ids": prompt}], params)  # 192 tokens cached, 58 after them
        assert llm.stats()["prefix_cache_hits"] > hits
    # K and V, float32, repeated to every query head
    per_token = 2 * llm.config.model.hf_config["num_attention_heads"] * runner.kv_spec.head_dim * 4
    assert max(profiled) == 256 * per_token  # the whole max_model_len context
    assert max(served) == 250 * per_token and max(served) <= max(profiled)


class FakeGraphCuda:
    """torch.cuda's memory and graph calls on CPU: each captured graph takes ``graph_bytes`` of torch's
    reserved memory and ``driver_bytes`` more of the device; the model runs eagerly inside a capture.
    (The model's forward is stood in for too: the graphs' padding rows write slot -1, which only the
    kernels that can be captured skip, and the torch backend refuses.)"""

    def __init__(self, monkeypatch, graph_bytes: int, driver_bytes: int, peak: int = 5 * GiB) -> None:
        self.graph_bytes, self.driver_bytes = graph_bytes, driver_bytes
        self.reserved, self.free = 6 * GiB, 80 * GiB - 2 * GiB - 6 * GiB - GiB  # 1 GiB outside torch
        self.calls: list[str] = []
        fake = self

        class Graph:
            def replay(self):
                raise AssertionError("a stand-in graph cannot replay")

        @contextlib.contextmanager
        def graph(g, pool=None):
            yield
            fake.calls.append("capture")
            fake.reserved += fake.graph_bytes
            fake.free -= fake.graph_bytes + fake.driver_bytes

        self.Graph = Graph
        for name, value in {
            "reset_peak_memory_stats": lambda device=None: None,
            "synchronize": lambda device=None: None,
            "max_memory_allocated": lambda device=None: peak,
            "memory_reserved": lambda device=None: self.reserved,
            "mem_get_info": lambda device=None: (self.free, 80 * GiB),
            "empty_cache": lambda: self.calls.append("empty_cache"),
            "graph_pool_handle": lambda: object(),
            "CUDAGraph": Graph,
            "graph": graph,
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)


def _graph_worker(llm, monkeypatch, **figures):
    worker = llm.core.executor.worker
    fake = FakeGraphCuda(monkeypatch, **figures)
    worker.device, worker._memory_at_start = torch.device("cuda", 0), (78 * GiB, 80 * GiB)
    worker.runner.graphs_unavailable = lambda: None  # as on CUDA with the triton backend
    forward, hidden = worker.runner.model.forward, llm.config.model.hf_config["hidden_size"]

    def decode_forward(input_ids, positions, kv_caches, meta):
        if meta.num_decodes == meta.num_seqs and set(meta.slot_mapping.tolist()) == {-1}:  # a bucket's padding
            fake.calls.append(f"forward {meta.num_seqs} over {kv_caches[0][0].shape[0]} blocks")
            return torch.zeros(len(input_ids), hidden)
        return forward(input_ids, positions, kv_caches, meta)

    worker.runner.model.forward = decode_forward
    return worker, fake, forward


def _buffer_bytes(max_num_seqs: int, max_blocks: int) -> int:
    """The buckets' static buffers: ids, positions and slots (int64), query starts, lengths and the
    block-table rows (int32)."""
    return 3 * 8 * max_num_seqs + 4 * (max_num_seqs + 1) + 4 * max_num_seqs + 4 * max_num_seqs * max_blocks


def _bucket_calls(num_blocks: int) -> list[str]:
    """Each bucket, largest first: its eager warm-up forward, then its capture (which runs it again)."""
    return [c for bs in (4, 2, 1) for c in (f"forward {bs} over {num_blocks} blocks",) * 2 + ("capture",)]


def test_cuda_graph_memory_is_measured_and_left_out_before_the_pool_is_sized(model_dirs, monkeypatch):
    with LLM(model_dirs["llama"], max_num_seqs=4, max_model_len=128, num_kv_blocks=20,
             attention_backend="torch") as llm:
        worker, fake, forward = _graph_worker(llm, monkeypatch, graph_bytes=100 * MiB, driver_bytes=10 * MiB)
        runner = worker.runner
        try:
            blocks = worker.determine_num_kv_blocks()
            # after the profile, the buckets 1, 2, 4 captured over a one-block throwaway pool, then released
            assert graph_batch_sizes(4) == [1, 2, 4]
            assert fake.calls == _bucket_calls(1) + ["empty_cache"]
            measured = 3 * 110 * MiB + _buffer_bytes(4, 128 // 16)
            reserve = graph_memory_reserve(measured)
            assert reserve == measured + measured // 20  # 5% more (above the 16 MiB least)
            budget = int(80 * GiB * 0.9) - 2 * GiB - 5 * GiB - GiB - reserve
            assert worker.memory_profile == {"used_by_others": 2 * GiB, "peak": 5 * GiB, "outside_torch": GiB,
                                             "kv_budget": budget, "cuda_graphs_reserved": reserve}
            assert blocks == budget // runner.kv_spec.bytes_per_block
            # the pool (a small one here) and then the real capture over it, which fits in what was left
            fake.calls.clear()
            worker.initialize_kv_cache(20)
            assert fake.calls == _bucket_calls(20)
            assert runner.graphs is not None and runner.graphs.memory_bytes == measured
            assert worker.memory_profile["cuda_graphs"] == measured
        finally:  # stand-in graphs cannot replay
            runner.graphs, runner.model.forward, worker.device = None, forward, torch.device("cpu")


def test_graphs_that_outgrow_what_the_budget_left_them_are_released(model_dirs, monkeypatch, caplog):
    with LLM(model_dirs["llama"], max_num_seqs=4, max_model_len=128, num_kv_blocks=20,
             attention_backend="torch") as llm:
        worker, fake, forward = _graph_worker(llm, monkeypatch, graph_bytes=100 * MiB, driver_bytes=0)
        runner = worker.runner
        try:
            worker.determine_num_kv_blocks()
            reserve = worker.memory_profile["cuda_graphs_reserved"]
            fake.graph_bytes = 110 * MiB  # the second capture takes 30 MiB more than the first, 16 MiB of slack
            with caplog.at_level(logging.WARNING, logger="workers.model_runner"):
                worker.initialize_kv_cache(20)
            assert runner.graphs is None and "cuda_graphs" not in worker.memory_profile
            assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
                f"CUDA graph capture failed (the graphs took {(330 * MiB + _buffer_bytes(4, 8)) / MiB:.0f} MiB, "
                f"more than the {reserve / MiB:.0f} MiB the KV budget left them): every step runs eagerly"]
        finally:
            runner.graphs, runner.model.forward, worker.device = None, forward, torch.device("cpu")
        out = llm.generate([{"prompt_token_ids": [1, 5, 9]}], SamplingParams(max_tokens=3, temperature=0))
        assert len(out[0].outputs[0].token_ids) == 3


def test_a_failed_capture_at_start_leaves_the_graphs_nothing(model_dirs, monkeypatch, caplog):
    with LLM(model_dirs["llama"], max_num_seqs=4, max_model_len=128, num_kv_blocks=20,
             attention_backend="torch") as llm:
        worker, fake, forward = _graph_worker(llm, monkeypatch, graph_bytes=100 * MiB, driver_bytes=0)

        def fail(*args, **kwargs):
            raise RuntimeError("CUDA error: out of memory")

        monkeypatch.setattr(torch.cuda, "CUDAGraph", fail)
        try:
            with caplog.at_level(logging.WARNING, logger="workers.model_runner"):
                worker.determine_num_kv_blocks()
                assert worker.memory_profile["cuda_graphs_reserved"] == 0
                assert worker.memory_profile["kv_budget"] == int(80 * GiB * 0.9) - 2 * GiB - 5 * GiB - GiB
                # no second capture is tried (it would have nothing left to fit in): every step runs eagerly
                monkeypatch.setattr(torch.cuda, "CUDAGraph", fake.Graph)
                captures = fake.calls.count("capture")
                worker.initialize_kv_cache(20)
                assert fake.calls.count("capture") == captures
            assert worker.runner.graphs is None
            assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
                "CUDA graph capture at start failed (RuntimeError: CUDA error: out of memory)",
                "CUDA graph capture failed (their capture at start failed): every step runs eagerly"]
        finally:
            worker.runner.model.forward, worker.device = forward, torch.device("cpu")
