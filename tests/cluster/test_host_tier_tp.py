"""The host KV tier at TP=2 on Ray worker actors: every rank offloads and restores its own shard of
the same blocks, so multi-turn conversations through a small pool give the tokens of TP=1 (and of
Hugging Face), with the same tier hits; a rebuilt worker group starts with an empty tier."""

from __future__ import annotations

import os
import signal

from engine import LLM
from tests.e2e.test_host_tier import GREEDY, TIER, conversations, run_turns


def test_tp2_with_the_tier_matches_tp1(ray_cluster, model_dirs, hf_oracle):
    model = model_dirs["llama"]
    convs = conversations(model, users=3, turns=3)
    oracle = hf_oracle("llama")
    settings = {**TIER, "attention_backend": "torch", "num_host_kv_blocks": 48}
    with LLM(model=model, **settings) as llm1:
        tp1 = run_turns(llm1, convs, oracle)
        stats1 = llm1.stats()
    with LLM(model=model, tensor_parallel_size=2, **settings) as llm:
        tp2 = run_turns(llm, convs, oracle)
        stats = llm.stats()
        assert stats["host_kv_cache_blocks"] == 48
        # each rank holds half the KV heads: a block's bytes per rank are half of TP=1's, over both ranks the same
        assert stats["kv_bytes_per_block_per_rank"] * 2 == stats1["kv_bytes_per_block_per_rank"]
        assert stats["kv_offload_bytes"] == stats1["kv_offload_bytes"] > 0
        for key in ("host_kv_cache_hits", "host_kv_cache_offloaded_blocks", "prefix_cache_hits"):
            assert stats[key] == stats1[key], key
        assert stats["host_kv_cache_hits"] > 0
        # a rank dies: the group is rebuilt with an empty tier, and the index forgets what it held
        assert llm.core.scheduler.kv.host_tier.num_resident > 0
        os.kill(llm.core.executor.worker_pids()[1], signal.SIGKILL)
        core = llm.core
        for i, c in enumerate(convs):
            core.add_request(f"k{i}", c[2], GREEDY)
        assert core.step() == []  # the lost rank is noticed: rebuilt, every request back in the queue
        assert llm.stats()["num_worker_restarts"] == 1
        assert core.scheduler.kv.host_tier.num_resident == 0 and core.cached_prefix_hashes() == b""
        finals = {}
        while core.has_unfinished_requests():
            finals.update((o.request_id, o) for o in core.step() if o.finished)
        again = [finals[f"k{i}"].outputs[0].token_ids for i in range(len(convs))]
        for c, tokens in zip(convs, again):
            oracle.assert_greedy(c[2], tokens)
        assert again == tp2[2]
    assert tp2 == tp1
