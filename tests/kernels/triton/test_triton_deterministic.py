"""``deterministic=True`` on the Triton path (here under the interpreter): a greedy request's tokens
and logprobs are the same to the bit whatever shares its batch, whatever the chunk budget, with or
without a prefix-cache hit. Interpreter-sized (the interpreter takes a fraction of a second a
step): a 24-token target, 3 others at a 16-token budget."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.e2e import test_deterministic as e2e
from tests.e2e.test_deterministic import random_prompt
from tests.kernels.triton.common import ulp

TARGET = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)


def run_with_others(llm: LLM, prompt: list[int], num_others: int, seed: int):
    """tests/e2e/test_deterministic.py's, interpreter-sized: others of 1-40 tokens, 1-5 new each."""
    return e2e.run_with_others(llm, prompt, num_others, seed, TARGET, max_other_len=40, max_other_tokens=5)


def engine(model_dir: str, deterministic: bool = True, **kwargs) -> LLM:
    kwargs = {"block_size": 8, "num_kv_blocks": 128, "max_model_len": 128, **kwargs}
    return LLM(model=model_dir, attention_backend="triton", deterministic=deterministic, **kwargs)


@pytest.fixture(scope="module")
def target():
    return random_prompt(random.Random(7), 24)


def test_same_bits_in_another_batch_chunking_and_cache_state(model_dirs, target):
    """One engine, a 16-token budget: the target alone (chunks of 16 + 8), then beside 3 others
    (its chunks cut where the others leave room), then beside 3 more with its first 2 blocks
    cached (the third recomputed), and alone again with the cache emptied."""
    with engine(model_dirs["llama"], max_num_batched_tokens=16) as llm:
        runner = llm.core.executor.worker.runner
        assert runner.attention_backend.name == "triton"
        assert runner.model.lm_head.linear is runner.attention_backend.fused_ops.linear_fixed_order
        alone, out = run_with_others(llm, target, 0, seed=0)
        assert out.num_cached_tokens == 0
        llm.reset_prefix_cache()
        crowded, out = run_with_others(llm, target, 3, seed=1)
        assert out.num_cached_tokens == 0 and crowded == alone
        warm, out = run_with_others(llm, target, 3, seed=2)
        assert out.num_cached_tokens == 16 and warm == alone
        assert llm.stats()["num_blocks_in_use"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_batch_invariant_linear_is_the_same_row_for_row(dtype):
    from kernels.triton.linear import BLOCK_M, linear_batch_invariant

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 80, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(2 * BLOCK_M + 6, 80, generator=gen).to(dtype)
    full = linear_batch_invariant(x, weight, bias)
    # against float64: the result is rounded to the dtype once (a spacing at most) after a float32 sum
    # of K products (each off by float32's eps relative, at most K eps x sum|x w| in all)
    ref = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    spread = torch.nn.functional.linear(x.double().abs(), weight.double().abs(), bias.double().abs())
    bound = ulp(ref, dtype) + 80 * torch.finfo(torch.float32).eps * spread
    assert ((full.double() - ref).abs() <= bound).all()
    cuts = ((0, 1), (5, 3), (BLOCK_M - 1, 2), (7, BLOCK_M + 1), (0, x.shape[0]))
    for start, rows in cuts:
        assert torch.equal(linear_batch_invariant(x[start:start + rows], weight, bias), full[start:start + rows])
    if dtype == torch.float32:  # the default path's product (BLAS) does change with the rows beside
        blas = torch.nn.functional.linear(x, weight, bias)
        assert any(not torch.equal(torch.nn.functional.linear(x[start:start + rows], weight, bias),
                                   blas[start:start + rows]) for start, rows in cuts)


def test_attention_rows_do_not_depend_on_the_batch_under_deterministic():
    """One sequence's query rows (20 tokens after a 40-token prefix, GQA 4:1) computed alone in one
    chunk, beside decodes and another prefill, and as a 5-token chunk: the same bits under
    ``deterministic``; without it the plan (tiles sized per launch, keys split by the launch's size,
    tl.dot) gives different bits for the same rows: shown with a backend that splits the keys by
    layout here, as an engine's does on a GPU (its 8 target programs split none of these launches)."""
    import math

    from kernels import PagedAttentionMetadata, paged_attention
    from kernels.triton import TritonAttentionBackend
    from tests.kernels.triton.common import Pool

    # 8-key tiles, split wherever a launch has fewer than 32 programs: the default plan cuts the keys of
    # the target's rows in 8 parts alone and in 4 beside the others (the bits of the interpreter's
    # numpy tl.dot alone may not differ between layouts: with some BLAS builds they do not)
    backend = TritonAttentionBackend(block_n=8, target_programs=32, min_split_tiles=1)
    pool = Pool(64, 8, 2, 32)
    heads, dim, scale = 8, 32, 1 / math.sqrt(32)
    gen = torch.Generator().manual_seed(3)
    table = pool.blocks(60)
    target_q = torch.randn(20, heads, dim, generator=gen)
    others = [(1, 37, pool.blocks(37)), (1, 9, pool.blocks(9)), (1, 200, pool.blocks(200))]
    other_prefill = (24, 50, pool.blocks(50))

    def rows(deterministic: bool, layout: str) -> torch.Tensor:
        """The target's last 5 rows of output in a step of the given layout."""
        if layout == "alone":
            seqs, q = [(20, 60, table)], target_q
        elif layout == "crowded":
            seqs = others + [other_prefill, (20, 60, table)]
            q = torch.cat([torch.randn(3 + 24, heads, dim, generator=torch.Generator().manual_seed(4)), target_q])
        else:  # its last 5 tokens as a chunk of their own
            seqs, q = [(5, 60, table)], target_q[15:]
        meta = PagedAttentionMetadata.build([s[0] for s in seqs], [s[1] for s in seqs], [s[2] for s in seqs], 8,
                                            backend=backend, deterministic=deterministic)
        flat = pool.k.view(-1, 2, dim)
        key, value = flat[meta.slot_mapping].clone(), pool.v.view(-1, 2, dim)[meta.slot_mapping].clone()
        return paged_attention(q, key, value, pool.k, pool.v, meta, scale)[-5:]

    exact = [rows(True, layout) for layout in ("alone", "crowded", "chunk")]
    assert all(torch.equal(exact[0], other) for other in exact[1:])
    assert not torch.isnan(exact[0]).any()
    default = [rows(False, layout) for layout in ("alone", "crowded", "chunk")]
    torch.testing.assert_close(default[0], exact[0], rtol=1e-5, atol=1e-5)
    assert any(not torch.equal(default[0], other) for other in default[1:])
