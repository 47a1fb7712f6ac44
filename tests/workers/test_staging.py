"""A step's inputs in one copy per dtype (``workers.staging``, the CUDA path's pinned uploads): the
packing on its own, and the engine run through it on CPU (``pin=False``), shared-prefix groups
included, producing the tokens the plain CPU path does."""

from __future__ import annotations

import numpy as np
import torch

from engine import LLM, SamplingParams
from workers.staging import Staging


def test_upload_packs_each_dtype_into_one_copy_and_keeps_shapes():
    staging = Staging(torch.device("cpu"), pin=False, initial=4)
    arrays = [np.arange(5, dtype=np.int64), np.arange(6, dtype=np.int32).reshape(2, 3),
              np.array([7, 8], dtype=np.int64), np.zeros((0, 4), dtype=np.int32)]
    out = staging.upload(arrays)
    assert staging.num_copies == 2
    for a, t in zip(arrays, out):
        assert t.dtype == torch.from_numpy(a).dtype and tuple(t.shape) == a.shape
        assert np.array_equal(t.numpy(), a)
    # the next step packs into the other buffers: this step's tensors stay as they were
    second = staging.upload([np.full(3, 9, dtype=np.int64), np.full((2, 2), 4, dtype=np.int32)])
    assert np.array_equal(out[0].numpy(), np.arange(5)) and np.array_equal(out[1].numpy(), arrays[1])
    assert second[0].tolist() == [9, 9, 9] and second[1].tolist() == [[4, 4], [4, 4]]
    # a step larger than the buffers grows them (to a power of two)
    big = staging.upload([np.arange(1000, dtype=np.int64)])
    assert big[0].tolist() == list(range(1000))
    assert staging._pairs[torch.int64][0].host.numel() == 1024  # (the third step: the first pair again)


def _shared_prefix_prompts():
    rng = np.random.default_rng(3)
    prefix = rng.integers(3, 500, 40).tolist()
    return [prefix + rng.integers(3, 500, 5 + i).tolist() for i in range(4)] + [rng.integers(3, 500, 9).tolist()]


def test_engine_through_the_staged_uploads_gives_the_same_tokens(model_dirs):
    prompts = [{"prompt_token_ids": p} for p in _shared_prefix_prompts()]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    results = []
    for staged in (False, True):
        with LLM(model_dirs["llama"], num_kv_blocks=64, block_size=8, max_model_len=256, attention_backend="cpu",
                 enable_prefix_caching=True) as llm:
            batch = llm.core.executor.worker.runner.batch
            if staged:
                batch.staging = Staging(torch.device("cpu"), pin=False)
            llm.generate(prompts[:1], params)  # the prefix cached: the others attend it as one group
            outs = llm.generate(prompts, params)
            results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
            if staged:
                assert batch.num_cascade_steps > 0
                steps = llm.stats()["num_steps"]
                # two dtypes a step (int64 ids / positions / slots, int32 lengths / table), one copy each
                assert batch.staging.num_copies == 2 * steps
    assert results[0] == results[1]
