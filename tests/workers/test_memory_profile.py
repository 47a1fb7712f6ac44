"""The CUDA memory profile: a prefill at the largest chunk and a full decode batch at ``max_model_len``
(the torch backend's decode gather in bounded slices), and the KV budget that leaves room for the
profile's peak and for memory outside torch's allocator. The CUDA calls are stood in for on CPU, so the
arithmetic and what is profiled are checked here; the figures themselves come from a GPU run."""

from __future__ import annotations

import pytest
import torch

import kernels.torch_attention as torch_attention
from engine import LLM, SamplingParams

GiB = 2**30


def test_profile_decode_runs_a_full_batch_at_max_model_len_in_bounded_slices(model_dirs, monkeypatch):
    with LLM(model_dirs["llama"], max_num_seqs=12, max_model_len=300, num_kv_blocks=40,
             attention_backend="torch") as llm:
        runner = llm.core.executor.worker.runner
        spec = runner.kv_spec
        bytes_per_token = 2 * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize
        # a budget of 5 sequences' contexts: the 12 decodes are gathered 5, 5 and 2 at a time
        monkeypatch.setattr(torch_attention, "DECODE_GATHER_BYTES", 5 * 304 * bytes_per_token)
        seen, slices = [], []
        forward, real_slices, sampler = runner.model.forward, torch_attention.decode_slices, runner.sampler

        def spy_forward(input_ids, positions, kv_caches, meta):
            seen.append((meta.num_decodes, list(meta.context_lens), positions.tolist(), kv_caches[0][0].shape[0]))
            return forward(input_ids, positions, kv_caches, meta)

        def spy_slices(*args, **kwargs):
            slices.append(real_slices(*args, **kwargs))
            return slices[-1]

        rows = []
        runner.model.forward = spy_forward
        monkeypatch.setattr(torch_attention, "decode_slices", spy_slices)
        runner.sampler = lambda logits, rs, *a: (rows.append((tuple(logits.shape), len(rs))),
                                                 sampler(logits, rs, *a))[1]
        runner.profile_decode()
        runner.model.forward, runner.sampler = forward, sampler
        ((num_decodes, contexts, positions, pool_blocks),) = seen
        assert num_decodes == 12 and contexts == [300] * 12 and positions == [299] * 12
        assert pool_blocks == -(-300 // 16) + 1  # one sequence's blocks (and the null block), shared by all
        # one plan per layer, over whole blocks (300 tokens are gathered as 19 blocks of 16)
        assert slices == [[(0, 5, 304), (5, 10, 304), (10, 12, 304)]] * spec.num_layers
        assert rows == [((12, llm.config.model.vocab_size), 12)]
        out = llm.generate([{"prompt_token_ids": [1, 5, 9]}], SamplingParams(max_tokens=3, temperature=0))
        assert len(out[0].outputs[0].token_ids) == 3


class FakeCuda:
    """torch.cuda's memory calls as the worker's profile makes them, with set figures."""

    def __init__(self, runner, free_after: int, peak: int, reserved: int) -> None:
        self.calls: list[str] = []
        self.free_after, self.peak, self.reserved = free_after, peak, reserved
        for name in ("profile_run", "profile_decode"):
            real = getattr(runner, name)
            setattr(runner, name, lambda real=real, name=name: (self.calls.append(name), real())[1])

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: self.calls.append("reset"))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self.calls.append("sync"))
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (self.free_after, 80 * GiB))


def _cuda_worker(llm, monkeypatch, **figures):
    worker = llm.core.executor.worker
    fake = FakeCuda(worker.runner, **figures)
    fake.install(monkeypatch)
    worker.device = torch.device("cuda", 0)
    worker._memory_at_start = (78 * GiB, 80 * GiB)  # 2 GiB held by others (and the CUDA context)
    return worker, fake


def test_kv_budget_leaves_the_profile_peak_and_memory_outside_torch(model_dirs, monkeypatch):
    with LLM(model_dirs["llama"], max_num_seqs=4, max_model_len=128, num_kv_blocks=20,
             attention_backend="torch") as llm:
        # after the profile: torch's allocator reserved 6 GiB (a peak of 5 GiB allocated), and 1.5 GiB
        # more is gone from the device than torch reserved (NCCL, library workspaces)
        worker, fake = _cuda_worker(llm, monkeypatch, free_after=80 * GiB - 2 * GiB - 6 * GiB - GiB * 3 // 2,
                                    peak=5 * GiB, reserved=6 * GiB)
        blocks = worker.determine_num_kv_blocks()
        assert fake.calls == ["reset", "profile_run", "profile_decode", "sync"]
        budget = int(80 * GiB * 0.9) - 2 * GiB - 5 * GiB - GiB * 3 // 2
        assert worker.memory_profile == {"used_by_others": 2 * GiB, "peak": 5 * GiB,
                                         "outside_torch": GiB * 3 // 2, "kv_budget": budget}
        assert blocks == worker.runner.kv_spec.num_blocks_for(budget) == budget // worker.runner.kv_spec.bytes_per_block
        worker.device = torch.device("cpu")


def test_no_room_for_the_kv_cache_is_one_clear_error(model_dirs, monkeypatch):
    with LLM(model_dirs["llama"], max_num_seqs=4, max_model_len=128, num_kv_blocks=20,
             attention_backend="torch") as llm:
        worker, _ = _cuda_worker(llm, monkeypatch, free_after=GiB, peak=60 * GiB, reserved=62 * GiB)
        with pytest.raises(ValueError, match=r"no memory left for the KV cache: 80\.0 GiB x gpu_memory_utilization "
                                             r"0\.9 minus 2\.0 GiB used elsewhere minus a peak of 60\.0 GiB .* "
                                             r"minus 15\.0 GiB outside torch's allocator"):
            worker.determine_num_kv_blocks()
        worker.device = torch.device("cpu")
