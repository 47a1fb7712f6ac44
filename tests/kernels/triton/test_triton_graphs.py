"""Decode steps through the CUDA-graph buckets (``workers.cuda_graphs``), here with the model run
eagerly over the static buffers instead of a graph replay (``capture=False``, under the Triton
interpreter), fed as on CUDA (staged copies, the block table's device copy gathered by row): the
buckets' padding, static metadata and launch plans (split-KV for max_model_len contexts, splits that
find no keys) give Hugging Face's tokens and the eager path's, and a padded step writes exactly its
own sequences' slots of the pool."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.e2e.prompts import test_prompts as make_prompts
from workers.staging import Staging

SETTINGS = dict(attention_backend="triton", block_size=8, num_kv_blocks=64, max_model_len=256,
                max_num_batched_tokens=64, max_num_seqs=4)


def _run(model_dir: str, prompts: list[list[int]], max_tokens: list[int], graphs: bool):
    """Outputs, and per decode-only step: (its sequences, the bucket, the slots written, the slots meant)."""
    steps = []
    with LLM(model=model_dir, **SETTINGS) as llm:
        runner = llm.core.executor.worker.runner
        if graphs:  # with the CUDA path's inputs too: staged copies, the block table's device copy
            runner.batch.use_staging(Staging(torch.device("cpu"), pin=False))
            assert runner.capture_graphs(capture=False, sizes=[1, 2, 4])
            # the bucket of 1 and 2 split a 256-token context's 8 key tiles in two (4 tiles each at
            # least); most of a decode's splits then find no keys
            assert [runner.graphs.metas[bs].backend_plan[1][0].num_splits for bs in (1, 2, 4)] == [2, 2, 1]
            run = runner.graphs.run

            def watched(input_ids, positions, meta, bs):
                before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
                out = run(input_ids, positions, meta, bs)
                changed = set()
                for (k0, v0), (k1, v1) in zip(before, runner.kv_caches):
                    diff = ((k0 != k1) | (v0 != v1)).flatten(2).any(-1)  # [blocks, block_size]
                    changed |= set(torch.nonzero(diff.flatten()).flatten().tolist())
                steps.append((meta.num_seqs, bs, changed, set(meta.slot_mapping.tolist())))
                return out

            runner.graphs.run = watched
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1)
                             for n in max_tokens])
        replays = runner.graphs.num_replays if graphs else 0
    return outs, steps, replays


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decode_buckets_match_hf_and_the_eager_path(arch, model_dirs, hf_oracle):
    prompts = make_prompts(model_dirs[arch])
    chosen = [prompts[0][:30], prompts[1][:19], prompts[2][:41], prompts[3][:12]]
    max_tokens = [7, 7, 5, 3]  # four decoding, then three (a padded bucket of 4), then two
    eager, _, _ = _run(model_dirs[arch], chosen, max_tokens, graphs=False)
    graphed, steps, replays = _run(model_dirs[arch], chosen, max_tokens, graphs=True)
    assert [(n, bs) for n, bs, _, _ in steps] == [(4, 4)] * 2 + [(3, 4)] * 2 + [(2, 2)] * 2
    assert replays == len(steps)
    for n, bs, changed, meant in steps:
        assert changed == meant and len(meant) == n  # the padding row wrote nothing
    for prompt, e, g in zip(chosen, eager, graphed):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        hf_oracle(arch).assert_greedy(prompt, g.outputs[0].token_ids)
        for le, lg in zip(e.outputs[0].logprobs, g.outputs[0].logprobs):
            assert le.keys() == lg.keys()
            for token in le:
                assert abs(le[token] - lg[token]) < 1e-4


def test_bench_gpu_compares_graph_replays_with_eager_steps_of_the_same_engine(model_dirs):
    """``kvserve bench-gpu``'s graphs-vs-eager check (``benchmarks.graph_agreement.graph_vs_eager``), its
    plumbing on CPU: every decode step through a bucket is also run eagerly on the same inputs, their
    logits compared; a bucket path that computes something else shows in the figures."""
    from benchmarks.graph_agreement import graph_vs_eager

    prompts = [p[:20] for p in make_prompts(model_dirs["llama"])[2:5]]
    with LLM(model=model_dirs["llama"], **SETTINGS) as llm:
        runner = llm.core.executor.worker.runner
        assert runner.capture_graphs(capture=False, sizes=[1, 2, 4])
        run = runner.graphs.run
        same = graph_vs_eager(llm, prompts, 4)
        assert runner.graphs.run == run  # put back
        replays = runner.graphs.num_replays
        runner.graphs.run = lambda *a: run(*a) * 1.01  # a bucket path that is slightly off
        off = graph_vs_eager(llm, prompts, 4)
    assert (same["steps"], same["positions"]) == (3, 9) and replays == 3  # 4 tokens: 3 decode steps of 3
    assert same["agreement"] == 1.0 and same["max_logit_diff"] < 1e-4 and same["max_abs_logit"] > 0.1
    assert off["positions"] == 9 and off["identical_logits"] == 0 and off["max_logit_diff"] > 1e-3
