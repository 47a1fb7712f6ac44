"""Block hashes: chained, stable across processes, separated by cache_salt."""

from __future__ import annotations

import os
import subprocess
import sys

from engine.block_hash import ROOT_BLOCK_HASH, hash_block, hash_blocks


def test_only_full_blocks_are_hashed_and_the_chain_links_them():
    hashes = hash_blocks(list(range(10)), 4)
    assert len(hashes) == 2
    assert hashes[0] == hash_block(ROOT_BLOCK_HASH, [0, 1, 2, 3])
    assert hashes[1] == hash_block(hashes[0], [4, 5, 6, 7])
    # the same block after another prefix hashes differently
    assert hash_blocks([9, 9, 9, 9, 4, 5, 6, 7], 4)[1] != hashes[1]


def test_cache_salt_changes_every_block():
    plain = hash_blocks(list(range(12)), 4)
    salted = hash_blocks(list(range(12)), 4, cache_salt="tenant-a")
    other = hash_blocks(list(range(12)), 4, cache_salt="tenant-b")
    assert all(a != b for a, b in zip(plain, salted))
    assert all(a != b for a, b in zip(salted, other))
    assert salted == hash_blocks(list(range(12)), 4, cache_salt="tenant-a")


def test_hashes_are_the_same_in_another_process():
    code = ("from engine.block_hash import hash_blocks; "
            "print(b''.join(hash_blocks(list(range(40)), 8, cache_salt='s')).hex())")
    here = b"".join(hash_blocks(list(range(40)), 8, cache_salt="s")).hex()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == here
