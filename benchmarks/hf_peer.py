"""Hugging Face transformers `generate` with static batches: the baseline a user would start from."""

from __future__ import annotations

import time

import torch

from benchmarks.workloads import Workload


def run_hf_static(model_dir: str, workload: Workload, batch_size: int = 8) -> dict:
    """Greedy generation of exactly ``workload.output_len`` tokens per prompt, ``batch_size`` prompts
    at a time (left-padded), one model forward per token for the whole batch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = model.generation_config.pad_token_id or 0

    def run(prompts: list[list[int]], new_tokens: int) -> int:
        width = max(map(len, prompts))
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
        return (out.shape[1] - width) * len(prompts)

    run(workload.prompts[:1], 2)  # warm-up
    start = time.perf_counter()
    generated = sum(run(workload.prompts[i:i + batch_size], workload.output_len)
                    for i in range(0, len(workload.prompts), batch_size))
    elapsed = time.perf_counter() - start
    return {"name": f"hf-static-b{batch_size}", "output_tokens": generated, "elapsed_s": elapsed,
            "output_tokens_per_s": generated / elapsed}
