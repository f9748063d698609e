"""Block-level prefix caching: which KV blocks hold which tokens' KV, shared by
reference count and kept, least recently used first out, while no sequence holds them.

A full block is named by a hash of its tokens and of the block before it (vLLM's scheme),
so two blocks with one hash hold the same tokens at the same positions after the same
prefix -- the same KV. Only full blocks whose KV is final get a name: a sequence's
partial last block, and anything a rewind may still take back, stay private. A named
block is immutable (no call writes a slot it already holds), so sharing needs no
copy-on-write: a sequence that shares one only ever writes after it.

Which block holds which name is kept by a ``BlockPool`` (``kv/block_pool.py``). The
target keeps one for its physical pages (``kv/block_tables.py``; ``kv/prefix_sharing.py``
names and shares its blocks), and the block ledger keeps one per target replica
(``kv/block_ledger.py``): the ledger decides which blocks a sequence shares, and the
target checks that each one really holds what the ledger says.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

ROOT_HASH = 0  # the "block before" the first block of every sequence


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """The name of a full block: 128 bits of BLAKE2b over the parent's name and the
    tokens. Python's ``hash`` of a tuple would do in one process but is 64 bits, and a
    collision here serves another prompt's KV; a block costs ~1 us either way."""
    digest = hashlib.blake2b(parent.to_bytes(16, "little") + np.asarray(tokens, np.int64).tobytes(), digest_size=16)
    return int.from_bytes(digest.digest(), "little")


def block_hashes(tokens: Sequence[int], block_size: int, parent: int = ROOT_HASH, first: int = 0,
                 count: int | None = None) -> list[int]:
    """The names of full blocks ``first``, ``first + 1``, ... of ``tokens`` (``count`` of
    them, or every full one), each chained to the one before; ``parent`` is block
    ``first - 1``'s name."""
    last = len(tokens) // block_size if count is None else min(len(tokens) // block_size, first + count)
    names = []
    for b in range(first, last):
        parent = block_hash(parent, tokens[b * block_size:(b + 1) * block_size])
        names.append(parent)
    return names


def cacheable_blocks(fed: int, block_size: int) -> int:
    """Most leading blocks a prefill of ``fed`` tokens may take from the cache: it still
    feeds at least its last token, whose logits give the first token and whose hidden
    states are the heads' anchor (so a hit costs the heads nothing, docs/design-decisions.md)."""
    return max(0, (fed - 1) // block_size)
