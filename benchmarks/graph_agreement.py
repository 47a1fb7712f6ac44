"""``kvserve bench-gpu``'s check of CUDA-graph replays against eager decode steps of the same engine
(``graph_vs_eager``), and the greedy settings the bench's agreement checks share."""

from __future__ import annotations


def greedy(max_tokens: int):
    """Greedy sampling of ``max_tokens`` tokens, end-of-sequence ignored."""
    from engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def graph_vs_eager(llm, prompts: list[list[int]], new_tokens: int) -> dict:
    """Greedy generation of ``prompts`` in which every decode step that runs through a CUDA-graph bucket
    is also run eagerly on the same inputs first (the model called directly with the step's own
    metadata and launch plan), the replay's output driving the generation: per decoding sequence and
    step, whether the two argmax tokens agree, and the largest logit difference. Both runs write the
    step's K/V to the same slots, the replay last, so every step reads the history the graphs made.
    On CPU the buckets run the model eagerly over their buffers (``capture_graphs(capture=False)``):
    the same comparison of the bucket path and the plain step."""
    import torch

    runner = llm.core.executor.worker.runner
    graphs = runner.graphs
    if graphs is None:
        raise ValueError("graph_vs_eager: the engine has no CUDA-graph buckets")
    stats = {"steps": 0, "positions": 0, "agreeing": 0, "identical_logits": 0, "max_logit_diff": 0.0,
             "max_abs_logit": 0.0}
    replay = graphs.run

    def compared(input_ids, positions, meta, bs):
        eager = runner.model.compute_logits(runner.model(input_ids, positions, runner.kv_caches, meta)).float()
        hidden = replay(input_ids, positions, meta, bs)
        graphed = runner.model.compute_logits(hidden).float()
        diff = (graphed - eager).abs().amax(-1)
        stats["steps"] += 1
        stats["positions"] += graphed.shape[0]
        stats["agreeing"] += int((graphed.argmax(-1) == eager.argmax(-1)).sum())
        stats["identical_logits"] += int((diff == 0).sum())
        stats["max_logit_diff"] = max(stats["max_logit_diff"], float(diff.max()))
        stats["max_abs_logit"] = max(stats["max_abs_logit"], float(eager.abs().max()))
        return hidden

    graphs.run = compared
    try:
        with torch.inference_mode():
            llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(new_tokens))
    finally:
        graphs.run = replay
    stats["agreement"] = stats["agreeing"] / max(1, stats["positions"])
    return stats
