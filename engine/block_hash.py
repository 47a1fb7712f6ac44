"""Chained hashes of full KV blocks: the keys of the prefix cache.

    hash(block i) = H(hash(block i-1), token ids of block i, extra keys)     hash(block -1) = ROOT

A block's hash names its whole prefix, so equal hashes mean equal KV. The hash is a keyed digest
with a fixed root, never Python's salted ``hash``: the scheduler, the router and every replica
compute the same value for the same tokens. Extra keys (``cache_salt``; the long factors of a LongRoPE
prompt) enter the first block only, which separates every later block of a tenant through the chain.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes
ROOT_BLOCK_HASH: BlockHash = hashlib.blake2b(b"kvserve prefix cache v1", digest_size=16).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """The hash of one full block after ``parent``."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def extra_keys_for(cache_salt: str | None, long_rope: bool = False) -> tuple:
    """``long_rope``: a prompt rotated with LongRoPE's long factors throughout (``engine.config.long_rope_threshold``)."""
    keys = ("salt", cache_salt) if cache_salt else ()
    return (*keys, "rope", "long") if long_rope else keys


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    parent: BlockHash = ROOT_BLOCK_HASH,
    start_block: int = 0,
    long_rope: bool = False,
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from ``start_block`` on, chained from ``parent``."""
    hashes = []
    extra = extra_keys_for(cache_salt, long_rope)
    for i in range(start_block, len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra if i == 0 else ())
        hashes.append(parent)
    return hashes
