"""Workload variants: the first and steady instances of a workload have the same shape and share no
prompt prefix; `varied` never repeats a prompt or output length; workloads survive JSON."""

from __future__ import annotations

import json

import pytest

from benchmarks.workloads import VARIANTS, WORKLOADS, Workload, build_workload, distinct_lengths, varied

BLOCK = 8  # the smallest KV block the benchmarks use: a shared prefix this long would be a cache hit


@pytest.fixture(scope="module")
def pairs(model_dirs):
    d = model_dirs["llama"]
    return {name: [build_workload(name, d, 0.25, 8, variant=v) for v in range(VARIANTS)] for name in WORKLOADS}


@pytest.mark.parametrize("name", WORKLOADS)
def test_variants_share_shape_not_prefixes(pairs, name):
    first, steady = pairs[name]
    assert (first.variant, steady.variant) == (0, 1)
    assert len(first.requests) == len(steady.requests) == 16
    assert [(r.user, r.turn) for r in first.requests] == [(r.user, r.turn) for r in steady.requests]
    if name not in ("mixed", "varied"):  # fixed lengths: the same ones in both
        assert [(len(r.prompt), r.output_len) for r in first.requests] == \
               [(len(r.prompt), r.output_len) for r in steady.requests]
    bos = first.requests[0].prompt[0]
    assert all(r.prompt[0] == bos for r in first.requests + steady.requests)
    heads = {tuple(r.prompt[1:1 + BLOCK]) for r in first.requests}
    assert not heads & {tuple(r.prompt[1:1 + BLOCK]) for r in steady.requests}


def test_shared_system_prompt_variants_each_share_their_own(pairs):
    first, steady = pairs["shared-system-prompt"]
    for w in (first, steady):
        system = w.requests[0].prompt[:400]
        assert all(r.prompt[:400] == system for r in w.requests)
    assert first.requests[0].prompt[:400] != steady.requests[0].prompt[:400]


def test_varied_lengths_never_repeat(pairs):
    first, steady = pairs["varied"]
    requests = first.requests + steady.requests
    assert len({len(r.prompt) for r in requests}) == len(requests)
    assert len({r.output_len for r in requests}) == len(requests)
    assert max(r.output_len for r in requests) <= 8 + len(requests)


def test_varied_at_full_scale(model_dirs):
    first, steady = (varied(model_dirs["llama"], variant=v) for v in (0, 1))
    requests = first.requests + steady.requests
    prompt_lens, output_lens = [len(r.prompt) for r in requests], [r.output_len for r in requests]
    assert len(set(prompt_lens)) == len(set(output_lens)) == 128
    assert min(prompt_lens) >= 16 and max(prompt_lens) <= 1024 and min(output_lens) >= 8 and max(output_lens) <= 256
    assert sorted(prompt_lens)[64] < 300  # geometric: many short, a few long


def test_distinct_lengths():
    assert distinct_lengths(5, 1, 5) == [1, 2, 3, 4, 5]
    values = distinct_lengths(100, 8, 256)
    assert values == sorted(set(values)) and values[0] == 8 and values[-1] == 256
    with pytest.raises(ValueError):
        distinct_lengths(6, 1, 5)


def test_smallest_sizes_build(model_dirs):
    for name in WORKLOADS:
        for v in range(VARIANTS):
            assert len(build_workload(name, model_dirs["llama"], 0.05, 3, variant=v).requests) >= 2


def test_json_round_trip(pairs):
    for first, _ in pairs.values():
        again = Workload.from_dict(json.loads(json.dumps(first.to_dict())))
        assert again == first and again.predecessor() == first.predecessor()
