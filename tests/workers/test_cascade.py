"""Shared-prefix group planning from a step's block tables."""

from __future__ import annotations

import numpy as np

from workers.cascade import plan_cascade


def table(*rows):
    width = max(len(r) for r in rows)
    return np.array([list(r) + [0] * (width - len(r)) for r in rows], dtype=np.int32)


def groups(plan):
    if plan is None:
        return []
    out = []
    for g in range(len(plan.lens)):
        members = plan.members[plan.member_start[g]:plan.member_start[g + 1]].tolist()
        out.append((sorted(members), int(plan.lens[g]), plan.block_tables[g].tolist()))
    return sorted(out)


def test_one_shared_system_prompt():
    t = table([1, 2, 3, 4, 10], [1, 2, 3, 4, 11], [1, 2, 3, 4, 12, 13])
    plan = plan_cascade(t, np.array([33, 35, 44]), block_size=8, min_shared_tokens=16)
    assert groups(plan) == [([0, 1, 2], 32, [1, 2, 3, 4])]
    assert plan.kv_starts.tolist() == [32, 32, 32]


def test_only_blocks_before_every_members_queries_are_shared():
    # sequence 2 starts computing at position 20: only its first two blocks are computed
    t = table([1, 2, 3, 4, 10], [1, 2, 3, 4, 11], [1, 2, 3, 4])
    plan = plan_cascade(t, np.array([33, 33, 20]), block_size=8, min_shared_tokens=8)
    # grouping all three saves 2 * 2 blocks; the first two alone save 1 * 4: the planner takes the larger
    assert groups(plan) == [([0, 1, 2], 16, [1, 2])]
    plan = plan_cascade(t, np.array([33, 33, 8]), block_size=8, min_shared_tokens=8)
    assert groups(plan) == [([0, 1], 32, [1, 2, 3, 4])]


def test_an_outlier_does_not_shorten_the_group():
    rows = [[1, 2, 3, 4, 5, 6, 7, 20 + i] for i in range(5)] + [[1, 9, 30]]
    plan = plan_cascade(table(*rows), np.array([60] * 5 + [20]), block_size=8, min_shared_tokens=8)
    assert groups(plan) == [([0, 1, 2, 3, 4], 56, [1, 2, 3, 4, 5, 6, 7])]


def test_separate_prompts_make_separate_groups_and_strangers_stay_out():
    t = table([1, 2, 40], [1, 2, 41], [5, 6, 42], [5, 6, 43], [7, 8, 44])
    plan = plan_cascade(t, np.array([17, 17, 17, 17, 17]), block_size=8, min_shared_tokens=16)
    assert groups(plan) == [([0, 1], 16, [1, 2]), ([2, 3], 16, [5, 6])]
    assert plan.kv_starts.tolist() == [16, 16, 16, 16, 0]


def test_nothing_worth_a_group():
    t = table([1, 2, 3], [1, 2, 4], [9, 10, 11])
    assert plan_cascade(t, np.array([20, 20, 20]), block_size=8, min_shared_tokens=32) is None  # 16 < 32
    assert plan_cascade(t[:1], np.array([20]), block_size=8) is None  # one sequence
    assert plan_cascade(t, np.array([0, 0, 0]), block_size=8) is None  # nothing computed yet


def test_nested_sharing_picks_the_partition_that_saves_most():
    # all four share block 1; pairs share three more blocks each
    t = table([1, 2, 3, 4, 50], [1, 2, 3, 4, 51], [1, 6, 7, 8, 52], [1, 6, 7, 8, 53])
    plan = plan_cascade(t, np.array([33] * 4), block_size=8, min_shared_tokens=8)
    # one group of four saves 3 * 1 block; two pairs save 1 * 4 each = 8
    assert groups(plan) == [([0, 1], 32, [1, 2, 3, 4]), ([2, 3], 32, [1, 6, 7, 8])]
