"""A step's inputs in one copy per dtype (``workers.staging``, the CUDA path's pinned uploads) and the
block table's device copy written by diffs (``workers.block_table``): the packing and the table on
their own, and the engine run through both on CPU (``pin=False``), shared-prefix groups included,
producing the tokens the plain CPU path does."""

from __future__ import annotations

import numpy as np
import torch

from engine import LLM, SamplingParams
from workers.block_table import BlockTable, DeviceBlockTable
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


def test_device_table_follows_random_diffs_through_growth_and_reused_rows():
    rng = np.random.default_rng(7)
    host = BlockTable(max_blocks_per_request=12, rows=2)
    host.add([5, 6])  # written before the device copy exists: taken by its first copy
    device = DeviceBlockTable(host, torch.device("cpu"))
    held: dict[int, int] = {0: 2}  # row -> blocks
    sent = 0
    for _ in range(300):
        op = rng.integers(3)
        if op == 0 or not held:
            ids = rng.integers(1, 1000, rng.integers(0, 5)).tolist()
            held[host.add(ids)] = len(ids)
            sent += len(ids)
        elif op == 1:
            row = int(rng.choice(list(held)))
            ids = rng.integers(1, 1000, rng.integers(0, 12 - held[row] + 1)).tolist()
            host.append(row, held[row], ids)
            held[row] += len(ids)
            sent += len(ids)
        else:
            row = int(rng.choice(list(held)))
            host.release(row)
            del held[row]
        if rng.integers(4) == 0:  # a step: the writes since the last one go over
            index, values = host.take_writes()
            device.apply(torch.from_numpy(index), torch.from_numpy(values))
            assert np.array_equal(device.table.numpy(), host.table)
            rows = list(held)[:3]
            width = int(rng.integers(1, 13))
            assert np.array_equal(device.gather(torch.tensor(rows, dtype=torch.long), width).numpy(), host.table[rows, :width])
    assert host.table.shape[0] > 2  # the table grew on both sides
    device.apply(*map(torch.from_numpy, host.take_writes()))
    assert np.array_equal(device.table.numpy(), host.table) and device.num_ids_written == sent


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
            written = [0]  # block ids the scheduler sent
            if staged:
                batch.use_staging(Staging(torch.device("cpu"), pin=False))
                update = batch.update

                def counting(so):
                    written[0] += sum(len(new.block_ids) for new in so.scheduled_new_reqs)
                    written[0] += sum(len(diff.new_block_ids or ()) for diff in so.scheduled_cached_reqs)
                    update(so)

                batch.update = counting
            llm.generate(prompts[:1], params)  # the prefix cached: the others attend it as one group
            outs = llm.generate(prompts, params)
            results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
            if staged:
                assert batch.num_cascade_steps > 0
                steps = llm.stats()["num_steps"]
                # two dtypes a step (int64 ids / positions / slots / table rows and indices, int32 lengths
                # and new block ids), one copy each
                assert batch.staging.num_copies == 2 * steps
                # the device table got each block id once, by diffs, and equals the host table
                assert batch.device_table.num_ids_written == written[0] > 0
                assert np.array_equal(batch.device_table.table.numpy(), batch.blocks.table)
    assert results[0] == results[1]
