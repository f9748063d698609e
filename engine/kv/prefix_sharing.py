"""Prefix caching on the target's pool: naming a sequence's final blocks, and starting a
new sequence on blocks that already hold its prompt's leading tokens.

A sequence's full blocks of final KV are named by their tokens (``publish``) and stay in
the pool after it is freed, so a later sequence that starts with the same tokens holds the
same blocks (``share``) instead of computing them. Named blocks are immutable: their KV is
in the pools (the owner writes the session copy out before ``publish``), no append writes
below a sequence's end, and a rewind into them is refused (``frozen``), so rewinds only
ever touch a sequence's private blocks. A named block no sequence holds is reused last
(least recently used first) when no free block is left. Not under a sliding window, whose
evictions would leave holes in a shared prefix.
"""
from __future__ import annotations

from typing import Hashable, Sequence

from specserve.engine.kv.block_pool import BlockPool
from specserve.engine.kv.errors import KVCacheError
from specserve.engine.kv.prefix_cache import ROOT_HASH, block_hashes, cacheable_blocks


class SharedPrefix:
    """How many of a sequence's leading table blocks are named (shared or published:
    immutable, never rewound), and the name of the last of them, which the next chains to."""

    __slots__ = ("frozen", "chain")

    def __init__(self) -> None:
        self.frozen = 0
        self.chain = ROOT_HASH


class PrefixSharing:
    def __init__(self, blocks: BlockPool, block_size: int) -> None:
        self.blocks, self.block_size = blocks, block_size

    @property
    def enabled(self) -> bool:
        return self.blocks.caching

    def share(self, seq_id: Hashable, prefix: SharedPrefix, tokens: Sequence[int],
              blocks: Sequence[int] | None) -> list[int]:
        """The cached blocks an empty sequence starts on, holding the leading full blocks
        of ``tokens`` (at most ``cacheable_blocks``: the last token is always fed), now
        held for it too. ``blocks``: the ones a ledger granted as cached (each must hold its
        block of ``tokens`` here, or this raises and changes nothing); None: the longest
        prefix this pool holds."""
        if not self.enabled:
            if blocks:
                raise KVCacheError(f"sequence {seq_id!r}: this pool caches no prefixes, so it has no blocks to share")
            return []
        limit = cacheable_blocks(len(tokens), self.block_size)
        names = block_hashes(tokens, self.block_size, count=limit)
        if blocks is None:
            blocks = self.blocks.lookup(names)
        else:
            blocks = [int(b) for b in blocks]
            wrong = [b for b, name in zip(blocks, names) if not self.blocks.holds(b, name)]
            if len(blocks) > limit or wrong:
                raise KVCacheError(f"sequence {seq_id!r}: blocks {wrong or blocks} do not hold the KV of its first "
                                   f"{len(blocks) * self.block_size} tokens in this pool; the ledger and the pool "
                                   "disagree")
        for block in blocks:
            self.blocks.share(block)
        prefix.frozen = len(blocks)
        prefix.chain = names[len(blocks) - 1] if blocks else ROOT_HASH
        return list(blocks)

    def publishable(self, prefix: SharedPrefix, tokens: Sequence[int], length: int) -> int:
        """Leading blocks of a sequence retaining ``length`` tokens that ``publish`` would
        name (its frozen ones included)."""
        full = min(len(tokens), length) // self.block_size
        return full if self.enabled and full > prefix.frozen else prefix.frozen

    def publish(self, prefix: SharedPrefix, table: Sequence[int | None], tokens: Sequence[int], full: int) -> None:
        """Name blocks ``frozen .. full`` of ``table`` by ``tokens`` (their KV is final and in
        the pools): from now on they are immutable and shareable."""
        names = block_hashes(tokens, self.block_size, prefix.chain, prefix.frozen, full - prefix.frozen)
        for index, name in zip(range(prefix.frozen, full), names):
            self.blocks.name(table[index], name)
        prefix.frozen, prefix.chain = full, names[-1]
