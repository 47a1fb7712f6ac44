"""The host KV tier on a real engine (the tiny checkpoints, the in-process executor): multi-turn
conversations through a pool too small to keep their history, the same tokens as Hugging Face
transformers (teacher forcing) with the tier on and off, a restored block bit-identical to the one
evicted, an abort while restored history is being prefilled, a failed step, the counters."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.block_hash import hash_blocks
from tests.e2e.prompts import corpus_ids
from tests.e2e.test_fault_injection import FaultyExecutor

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# a pool of 24 usable blocks (384 tokens): one user's third turn (~170 tokens) and a bit
TIER = dict(block_size=BS, num_kv_blocks=25, max_model_len=256, max_num_seqs=4, attention_backend="cpu")


@pytest.fixture(scope="module")
def llama(model_dirs):
    return model_dirs["llama"]


def conversations(model_dir: str, users: int = 4, turns: int = 3) -> list[list[list[int]]]:
    """``users`` conversations: turn t's prompt is turn t - 1's plus a scripted reply and a new
    message (as a chat client resends its history); 40 + 56 tokens a turn, from the corpus."""
    ids = corpus_ids(f"{model_dir}/tokenizer.json")
    out = []
    for u in range(users):
        pos, history, prompts = 1000 + 900 * u, [], []
        for _ in range(turns):
            history = history + list(ids[pos:pos + 40])
            prompts.append(list(history))
            history = history + list(ids[pos + 40:pos + 56])
            pos += 56
        out.append(prompts)
    return out


def run_turns(llm, convs, oracle):
    """Each turn of every user, one batch per turn; every output checked against HF."""
    tokens = []
    for turn in range(len(convs[0])):
        prompts = [c[turn] for c in convs]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        for prompt, out in zip(prompts, outs):
            oracle.assert_greedy(prompt, out.outputs[0].token_ids)
        tokens.append([o.outputs[0].token_ids for o in outs])
    return tokens


def test_multi_turn_with_the_tier_on_and_off_matches_hf(llama, hf_oracle):
    convs = conversations(llama)
    oracle = hf_oracle("llama")
    results = {}
    for name, extra in (("off", {}), ("on", {"num_host_kv_blocks": 64})):
        with LLM(model=llama, **TIER, **extra) as llm:
            tokens = run_turns(llm, convs, oracle)
            stats = llm.stats()
            assert stats["num_blocks_in_use"] == 0
            results[name] = (tokens, stats)
    assert results["on"][0] == results["off"][0]
    on, off = results["on"][1], results["off"][1]
    # turns 1 and 2 find the whole previous prompt (full blocks) with the tier; without it, less
    ideal = sum(len(c[t - 1]) // BS * BS for c in convs for t in (1, 2))
    assert on["prefix_cache_hits"] == ideal > off["prefix_cache_hits"]
    assert on["host_kv_cache_hits"] == on["host_kv_cache_hit_blocks"] * BS > 0
    assert on["host_kv_cache_offloaded_blocks"] > 0 and on["host_kv_cache_blocks"] == 64
    assert on["kv_offload_bytes"] == on["host_kv_cache_offloaded_blocks"] * on["kv_bytes_per_block_per_rank"]
    assert on["kv_restore_bytes"] == on["host_kv_cache_hit_blocks"] * on["kv_bytes_per_block_per_rank"]
    assert on["host_kv_cache_blocks_used"] == min(64, on["host_kv_cache_offloaded_blocks"])
    assert off["host_kv_cache_blocks"] == off["host_kv_cache_hits"] == off["kv_offload_bytes"] == 0


def pool_blocks(llm, block_ids):
    """Every layer's K and V of these pool blocks, copied."""
    kv_caches = llm.core.executor.worker.runner.kv_caches
    return [(k[block_ids].clone(), v[block_ids].clone()) for k, v in kv_caches]


def test_a_block_restored_from_the_tier_is_bit_identical_to_the_one_evicted(llama):
    ids = corpus_ids(f"{llama}/tokenizer.json")
    prompt = list(ids[3000:3000 + 3 * BS + 1])  # 3 full blocks + 1 token
    hashes = hash_blocks(prompt, BS)[:3]
    with LLM(model=llama, block_size=BS, num_kv_blocks=9, max_model_len=128, num_host_kv_blocks=16,
             attention_backend="cpu") as llm:
        first = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids
        pool = llm.core.scheduler.kv.block_pool
        before = [next(iter(pool.cached[h])) for h in hashes]
        saved = pool_blocks(llm, before)
        # other prompts fill the pool: the first prompt's blocks are evicted into the tier
        llm.generate([{"prompt_token_ids": list(ids[4000 + 200 * i:4000 + 200 * i + 7 * BS])} for i in range(2)],
                     GREEDY)
        tier = llm.core.scheduler.kv.host_tier
        assert all(h not in pool.cached and h in tier for h in hashes)
        slots = {e.block_hash: e.slot for e in tier.resident()}
        host = llm.core.executor.worker.host_tier.buffer
        for layer, (k, v) in enumerate(saved):
            for i, h in enumerate(hashes):
                assert torch.equal(host[layer, 0, slots[h]], k[i]) and torch.equal(host[layer, 1, slots[h]], v[i])
        hits = llm.stats()["host_kv_cache_hit_blocks"]
        again = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0]
        assert again.outputs[0].token_ids == first and again.num_cached_tokens == 3 * BS
        assert llm.stats()["host_kv_cache_hit_blocks"] == hits + 3
        after = [next(iter(pool.cached[h])) for h in hashes]
        restored = pool_blocks(llm, after)
        for (k0, v0), (k1, v1) in zip(saved, restored):
            assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_an_abort_while_restored_history_is_prefilled_leaves_it_cached(llama, hf_oracle):
    """A budget of 16 tokens a step: the second turn restores the first turn's blocks, starts its
    prefill, and is aborted. The restored blocks stay in the prefix cache; the same turn sent again
    hits them there (no second restore), nothing leaks, the tokens are HF's."""
    ids = corpus_ids(f"{llama}/tokenizer.json")
    turn0 = list(ids[5000:5000 + 4 * BS + 3])
    turn1 = turn0 + list(ids[6000:6000 + 3 * BS])
    with LLM(model=llama, block_size=BS, num_kv_blocks=10, max_model_len=144, num_host_kv_blocks=32,
             max_num_batched_tokens=BS, attention_backend="cpu") as llm:
        llm.generate({"prompt_token_ids": turn0}, GREEDY)
        llm.generate({"prompt_token_ids": list(ids[7000:7000 + 8 * BS])}, GREEDY)  # evicts turn 0
        core, kv = llm.core, llm.core.scheduler.kv
        assert all(h in kv.host_tier for h in hash_blocks(turn0, BS)[:4])
        hits = llm.stats()["host_kv_cache_hit_blocks"]
        core.add_request("t1", turn1, GREEDY)
        core.step()  # restores 4 blocks, computes the first 16 of the rest
        assert llm.stats()["host_kv_cache_hit_blocks"] == hits + 4
        core.step()
        assert core.scheduler.requests["t1#0"].num_computed_tokens == 4 * BS + 2 * BS
        core.abort_request("t1")
        stats = llm.stats()
        assert stats["num_blocks_in_use"] == 0 and not core.has_unfinished_requests()
        out = llm.generate({"prompt_token_ids": turn1}, GREEDY)[0]
        # the restored history, and the two blocks computed before the abort, come from the pool
        assert out.num_cached_tokens == 6 * BS
        assert llm.stats()["host_kv_cache_hit_blocks"] == hits + 4
        hf_oracle("llama").assert_greedy(turn1, out.outputs[0].token_ids)


class RecordingFaultyExecutor(FaultyExecutor):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.seen = []

    def execute_model(self, scheduler_output):
        self.seen.append(scheduler_output)
        return super().execute_model(scheduler_output)


def test_an_interrupted_step_that_restores_leaves_no_trace_and_the_rerun_is_right(llama, hf_oracle):
    convs = conversations(llama, users=3, turns=2)
    oracle = hf_oracle("llama")
    ids = corpus_ids(f"{llama}/tokenizer.json")
    with LLM(model=llama, block_size=BS, num_kv_blocks=12, max_model_len=176, num_host_kv_blocks=64,
             attention_backend="cpu") as llm:
        run_turns(llm, [c[:1] for c in convs], oracle)
        llm.generate({"prompt_token_ids": list(ids[9000:9000 + 10 * BS])}, GREEDY)  # evicts turn 0
        kv = llm.core.scheduler.kv
        assert all(h in kv.host_tier for c in convs for h in hash_blocks(c[0], BS))
        resident, hits = set(kv.host_tier.resident()), kv.tier_stats.hits
        pool = kv.block_pool
        faulty = RecordingFaultyExecutor(llm.core, KeyboardInterrupt(), {1})
        prompts = [c[1] for c in convs]
        with pytest.raises(KeyboardInterrupt):  # the step that restores turn 0's blocks
            llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert len(faulty.seen[0].kv_restores) >= 2
        assert set(kv.host_tier.resident()) <= resident and kv.tier_stats.hits == hits
        assert not any(h in pool.cached for c in convs for h in hash_blocks(c[0], BS))  # restores undone
        assert llm.stats()["num_blocks_in_use"] == 0
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert faulty.calls > 1
        for prompt, out in zip(prompts, outs):
            oracle.assert_greedy(prompt, out.outputs[0].token_ids)
        assert kv.tier_stats.hits > hits


def test_settings_are_checked(llama):
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        LLM(model=llama, enable_prefix_caching=False, num_host_kv_blocks=8)
    with pytest.raises(ValueError, match="num_host_kv_blocks must be an integer >= 0"):
        LLM(model=llama, num_host_kv_blocks=-1)
    with LLM(model=llama, block_size=BS, num_kv_blocks=20, max_model_len=128, attention_backend="cpu",
             kv_offload_bytes=1 << 20) as llm:
        stats = llm.stats()
        assert stats["host_kv_cache_blocks"] == (1 << 20) // stats["kv_bytes_per_block_per_rank"]
        assert stats["host_kv_bytes_per_rank"] == stats["host_kv_cache_blocks"] * stats["kv_bytes_per_block_per_rank"]


def test_metrics_carry_the_tier_counters(llama):
    """stats() through the Prometheus exposition: every tier family with the engine's exact value."""
    from prometheus_client.parser import text_string_to_metric_families

    from api.metrics import prometheus_text

    convs = conversations(llama, users=3, turns=2)
    with LLM(model=llama, block_size=BS, num_kv_blocks=12, max_model_len=176, num_host_kv_blocks=6,
             attention_backend="cpu") as llm:
        for turn in range(2):
            llm.generate([{"prompt_token_ids": c[turn]} for c in convs], GREEDY)
        stats = llm.stats()
    assert stats["host_kv_cache_evictions"] > 0 and stats["host_kv_cache_blocks_used"] == 6  # a full tier
    assert stats["host_kv_cache_usage"] == 1.0
    families = {f.name: f for f in text_string_to_metric_families(prometheus_text({"r0": stats}, "tiny"))}
    expected = {
        "kvserve:host_kv_cache_queries": ("counter", stats["host_kv_cache_queries"]),
        "kvserve:host_kv_cache_hits": ("counter", stats["host_kv_cache_hits"]),
        "kvserve:host_kv_cache_offloaded_blocks": ("counter", stats["host_kv_cache_offloaded_blocks"]),
        "kvserve:host_kv_cache_evictions": ("counter", stats["host_kv_cache_evictions"]),
        "kvserve:kv_offload_bytes": ("counter", stats["kv_offload_bytes"]),
        "kvserve:kv_restore_bytes": ("counter", stats["kv_restore_bytes"]),
        "kvserve:host_kv_cache_usage_perc": ("gauge", 1.0),
        "kvserve:host_kv_cache_blocks": ("gauge", 6),
    }
    for name, (kind, value) in expected.items():
        family = families[name]
        assert family.type == kind
        [sample] = [s for s in family.samples if not s.name.endswith("_created")]
        assert sample.value == value and sample.labels == {"model_name": "tiny", "replica": "r0"}
    assert stats["kv_offload_bytes"] > 0 and stats["kv_restore_bytes"] > 0
