"""The start-up forward (memory profile on CUDA, warm-up on CPU) includes the sampler over a full batch
on its costliest path, so its temporaries are part of the measured peak."""

from __future__ import annotations

from engine import LLM, SamplingParams


def test_profile_run_samples_a_full_batch_on_the_costliest_path(model_dirs):
    with LLM(model_dirs["llama"], max_num_seqs=24, num_kv_blocks=160, max_logprobs=7) as llm:
        runner = llm.core.executor.worker.runner
        seen = []
        sampler = runner.sampler

        def spy(logits, rows, *args):
            seen.append((tuple(logits.shape), rows))
            return sampler(logits, rows, *args)

        runner.sampler = spy
        runner.profile_run()
        ((shape, rows),) = seen
        assert shape == (24, llm.config.model.vocab_size) and len(rows) == 24
        assert {r.params.logprobs for r in rows} == {7} and len({r.params.seed for r in rows}) == 24
        params = rows[0].params
        assert params.has_penalties and params.top_k and params.top_p < 1 and params.min_p > 0
        runner.sampler = sampler
        out = llm.generate([{"prompt_token_ids": [1, 5, 9]}], SamplingParams(max_tokens=3, temperature=0))
        assert len(out[0].outputs[0].token_ids) == 3
