"""The variants an engine compiles at start (``kernels.triton.warmup``) against the variants it then
launches, here under the interpreter (the warm-up makes the same calls; only Triton's ``warmup``, a
compile, does nothing there): every launch of a run — decodes and prefill chunks, split and unsplit,
the CUDA-graph buckets (run eagerly), the step's inputs staged at any offset of one buffer as on
CUDA, deterministic mode — is of a variant the warm-up compiled. The split-KV scratch is the one
buffer the engine allocated at start, whatever the step; split counts are powers of two within it."""

from __future__ import annotations

import threading

import pytest
import torch

from engine import LLM, SamplingParams
from kernels.triton.backend import AttentionShape, TritonAttentionBackend
from kernels.triton.warmup import (
    attention_launches,
    distinct,
    layer_launches,
    record_launches,
    runner_shape,
    warm_up_runner,
)
from tests.e2e.prompts import test_prompts as make_prompts
from workers.staging import Staging

SETTINGS = dict(attention_backend="triton", block_size=8, num_kv_blocks=64, max_model_len=256,
                max_num_batched_tokens=32, max_num_seqs=4)


def _run(model_dir: str, deterministic: bool, graphs: bool, kv_cache_dtype: str = "auto"):
    prompts = make_prompts(model_dir)
    chosen = [prompts[6][:70], prompts[2][:20], prompts[1], prompts[3][:45]]  # 70 and 45 come in chunks of 32
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (6, 5, 4, 3)]
    with LLM(model=model_dir, deterministic=deterministic, kv_cache_dtype=kv_cache_dtype, **SETTINGS) as llm:
        runner = llm.core.executor.worker.runner
        runner.batch.use_staging(Staging(torch.device("cpu"), pin=False))  # the inputs as a CUDA step sends them
        with record_launches() as warm:
            done = warm_up_runner(runner)
        with record_launches() as used:
            if graphs:
                assert runner.capture_graphs(capture=False, sizes=[1, 2, 4])
            llm.generate([{"prompt_token_ids": p} for p in chosen], params)
        return distinct(warm), distinct(used), done, runner


def _describe(launches) -> list[str]:
    return [f"{launch.name} {launch.constexprs} {launch.key[1]}" for launch in launches]


@pytest.mark.parametrize("arch,deterministic,graphs,kv_cache_dtype", [
    ("llama", False, True, "auto"), ("qwen2", False, False, "auto"), ("llama", True, False, "auto"),
    ("llama", False, True, "int8")])
def test_the_warm_up_compiles_every_variant_a_run_launches(arch, deterministic, graphs, kv_cache_dtype, model_dirs):
    """A quantized pool (int8) launches the store and attention of its format: compiled too."""
    warm, used, done, runner = _run(model_dirs[arch], deterministic, graphs, kv_cache_dtype)
    missing = [used[key] for key in used.keys() - warm.keys()]
    assert not missing, "\n".join(_describe(missing))
    attention = [launch for launch in used.values() if launch.name == "_paged_attention_kernel"]
    backend = runner.attention_backend
    group = runner.config.model.hf_config["num_attention_heads"] // runner.kv_spec.num_kv_heads
    decode_q = backend.block_q(True, group, deterministic, runner.kv_spec.head_dim)
    prefill_q = backend.block_q(False, group, deterministic, runner.kv_spec.head_dim)
    # the run was not a trivial one: both tiles; split launches where the graph buckets plan for a
    # max_model_len context (8 key tiles: 2 splits of 4 tiles at least), the prompts here being shorter
    assert {launch.constexprs["BLOCK_Q"] for launch in attention} == {decode_q, prefill_q}
    splits = {launch.constexprs["NUM_SPLITS"] for launch in attention}
    assert splits == ({1, 2} if graphs else {1}), splits
    fmt = 3 if kv_cache_dtype == "int8" else 0
    assert {launch.constexprs.get("KV_FORMAT", 0) for launch in used.values()
            if launch.name in ("_paged_attention_kernel", "_store_kv_kernel")} == {fmt}
    assert done["attention_variants"] == len(distinct(attention_launches(backend, runner_shape(runner))))
    assert done["compiled"] is False  # interpreted: enumerated, nothing compiled


def test_split_launches_use_the_scratch_allocated_at_start(model_dirs):
    prompts = make_prompts(model_dirs["llama"])
    with LLM(model=model_dirs["llama"], **SETTINGS) as llm:
        backend = llm.core.executor.worker.runner.attention_backend
        scratch = backend.scratch  # allocated by the runner at its start, before any forward
        kv_heads = llm.core.executor.worker.runner.kv_spec.num_kv_heads
        # a launch of d decodes splits at most ceil(target_programs / (d x kv_heads)) ways: at most
        # target_programs / kv_heads + d rows, here 8 / 2 + 4 (max_num_seqs)
        assert scratch is not None and scratch.rows == -(-backend.target_programs // kv_heads) + 4 == 8
        heads = llm.core.executor.worker.runner.config.model.hf_config["num_attention_heads"]
        assert scratch.part.numel() == scratch.rows * heads * scratch.head_p2
        backend.min_split_tiles = 1  # split these short contexts too (2 key tiles: 2 splits)
        with record_launches() as used:
            llm.generate([{"prompt_token_ids": p[:40]} for p in prompts[2:6]],
                         SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert backend.scratch is scratch
    split = [launch for launch in used if launch.constexprs.get("NUM_SPLITS", 1) > 1]
    assert split and all(launch.args[4] is scratch.part for launch in split
                         if launch.name == "_paged_attention_kernel")
    assert all(launch.args[1] is scratch.part for launch in split if launch.name == "_merge_splits_kernel")


def test_the_scratch_holds_every_decode_launch_without_capping_its_splits():
    """scratch_rows bounds what the planner wants for any number of decodes (an H100's 264 target
    programs, 8 KV heads, 256 decodes at a 128k context): decodes never lose splits to the scratch."""
    backend = TritonAttentionBackend(target_programs=264, min_split_tiles=4, max_splits=32)
    shape = AttentionShape(dtype=torch.float16, num_heads=32, kv_heads=8, head_dim=128, block_size=16,
                           max_decodes=256, max_model_len=131072)
    rows = backend.scratch_rows(shape)
    assert rows == 33 + 256  # 8192 rows were allocated before: max_decodes x max_splits
    assert max(backend.num_splits(d, 8, 131072, d) * d for d in range(1, 257)) <= rows
    assert backend.num_splits(1, 8, 131072, 1) == 32  # one decode still takes every split


def test_split_counts_are_powers_of_two_within_the_scratch():
    backend = TritonAttentionBackend(target_programs=264, min_split_tiles=4, max_splits=32)
    assert backend.num_splits(1, 8, 4096) == 32  # wanted 33, capped
    assert backend.num_splits(1, 8, 4096 - 32 * 4 * 5) == 16  # 108 key tiles / 4 = 27 -> 16
    assert backend.num_splits(5, 8, 4096) == 4  # 7 wanted -> 4
    assert backend.num_splits(1, 8, 4096, num_tokens=200) == 8  # 2048 scratch rows / 200 tokens = 10 -> 8
    assert backend.split_counts(8, 4096) == [1, 2, 4, 8, 16, 32]
    assert backend.split_counts(8, 256) == [1, 2]  # 8 key tiles of 32, 4 each at least
    with pytest.raises(ValueError, match="power of two"):
        TritonAttentionBackend(max_splits=24)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_layer_enumeration_is_what_the_model_launches(arch, model_dirs):
    """``layer_launches`` (the compile check's layer ops at real models' widths, without a model) gives
    exactly the layer-op variants a model of those widths launches, deterministic linear included."""
    prompts = make_prompts(model_dirs[arch])
    with LLM(model=model_dirs[arch], deterministic=True, **SETTINGS) as llm:
        runner = llm.core.executor.worker.runner
        with record_launches() as used:
            llm.generate([{"prompt_token_ids": prompts[2][:12]}],
                         SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        cfg = runner.config.model.hf_config
        dtype = runner.dtype
    layer_kernels = ("_rms_norm_kernel", "_rotary_neox_kernel", "_silu_and_mul_kernel", "_linear_kernel")
    launched = {k for k, launch in distinct(used).items() if launch.name in layer_kernels}
    heads = cfg["num_attention_heads"]
    enumerated = distinct(layer_launches(dtype, cfg["hidden_size"], cfg["intermediate_size"], heads,
                                         cfg.get("num_key_value_heads") or heads,
                                         cfg.get("head_dim") or cfg["hidden_size"] // heads, cfg["vocab_size"],
                                         qkv_bias=arch == "qwen2" or cfg.get("attention_bias", False),
                                         deterministic=True))
    assert launched == set(enumerated), (_describe([enumerated[k] for k in set(enumerated) - launched]),
                                         sorted(map(str, launched - set(enumerated))))


def test_a_dry_recording_skips_only_its_own_threads_launches():
    """A warm-up's dry run (record, launch nothing) beside another thread's work: that thread's
    kernels run and are not recorded."""
    from kernels.triton import ops

    x = torch.randn(3, 64)
    want = torch.nn.functional.silu(x[:, :32]) * x[:, 32:]
    got = {}
    with record_launches(dry=True) as recorded:
        worker = threading.Thread(target=lambda: got.setdefault("out", ops.silu_and_mul(x)))
        worker.start()
        worker.join()
        skipped = ops.silu_and_mul(x)  # this thread's: recorded, not run (its output never written)
    torch.testing.assert_close(got["out"], want, rtol=1e-5, atol=1e-6)
    assert [launch.name for launch in recorded] == ["_silu_and_mul_kernel"]
    assert skipped.shape == want.shape
