"""The bookkeeping of one KV pool's block ids: free, cached (named, unheld) or held.

The target's block tables keep one for its physical pages (``kv/block_tables.py``) and
the block ledger one per target replica (``kv/block_ledger.py``). Names are those of
``kv/prefix_cache.py``: a named block holds one full block of final KV.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence


class BlockPool:
    """One pool's block ids, each in one of three states:

    - **free**: holds nothing worth keeping;
    - **cached**: holds a named full block and no sequence holds it: it can be shared
      again, or taken (evicted, least recently used first) when no free block is left;
    - **held** by one or more sequences (their tables or reservations): ``holders``
      counts them, and a named held block is shared by every holder.

    ``available`` (free + cached) is what allocation can take.
    """

    def __init__(self, num_blocks: int, caching: bool = True) -> None:
        self.num_blocks, self.caching = num_blocks, caching
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 goes first
        self._cached: OrderedDict[int, None] = OrderedDict()  # named, unheld; least recently used first
        self.holders: dict[int, int] = {}
        self.names: dict[int, int] = {}  # block -> the name of what it holds
        self._index: dict[int, int] = {}  # name -> a block holding it (the first one named so)

    # -- counts --------------------------------------------------------------------------
    @property
    def available(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def cached(self) -> int:
        """Named blocks no sequence holds (kept for later prompts, taken when needed)."""
        return len(self._cached)

    @property
    def named(self) -> int:
        return len(self.names)

    def is_available(self, block: int) -> bool:
        return block not in self.holders and 0 <= block < self.num_blocks

    # -- taking and giving back ----------------------------------------------------------
    def take(self, n: int) -> list[int]:
        """``n`` available blocks for one holder: free ones first, then the least recently
        used cached ones (forgetting what they held). The caller checks ``available``."""
        if n > self.available:
            raise ValueError(f"{n} blocks wanted, {self.available} available")
        taken = []
        for _ in range(n):
            block = self._free.pop() if self._free else self._cached.popitem(last=False)[0]
            self._forget(block)
            self.holders[block] = 1
            taken.append(block)
        return taken

    def take_these(self, blocks: Sequence[int]) -> None:
        """Take named blocks for one holder (a reservation a ledger granted): each must be
        available; a cached one forgets what it held. All or nothing."""
        if len(set(blocks)) != len(blocks) or not all(self.is_available(b) for b in blocks):
            raise ValueError(f"blocks {[b for b in blocks if not self.is_available(b)] or list(blocks)} are not "
                             "all available and distinct")
        chosen = set(blocks)
        self._free = [b for b in self._free if b not in chosen]
        for block in blocks:
            self._cached.pop(block, None)
            self._forget(block)
            self.holders[block] = 1

    def share(self, block: int) -> None:
        """One more holder of a named block (cached, or held by others)."""
        if block not in self.names:
            raise ValueError(f"block {block} holds no named KV to share")
        self._cached.pop(block, None)
        self.holders[block] = self.holders.get(block, 0) + 1

    def drop(self, block: int) -> None:
        """One holder lets go; with the last one a named block becomes cached (most
        recently used), any other free."""
        left = self.holders[block] - 1
        if left:
            self.holders[block] = left
            return
        del self.holders[block]
        if block in self.names:
            self._cached[block] = None
        else:
            self._free.append(block)

    # -- names ---------------------------------------------------------------------------
    def name(self, block: int, name: int) -> None:
        """``block`` (held) now holds the full block called ``name``, for good: it can be
        shared. A second block with a name already known keeps it too (either may be
        shared by a caller that names it), but lookups find the first."""
        if not self.caching:
            return
        self.names[block] = name
        self._index.setdefault(name, block)

    def holds(self, block: int, name: int) -> bool:
        return self.names.get(block) == name

    def lookup(self, names: Iterable[int]) -> list[int]:
        """The blocks holding the longest prefix of ``names`` (in order)."""
        found = []
        for name in names:
            block = self._index.get(name)
            if block is None:
                break
            found.append(block)
        return found

    def touch(self, blocks: Iterable[int]) -> None:
        """These cached blocks were just used: last to be evicted."""
        for block in blocks:
            if block in self._cached:
                self._cached.move_to_end(block)

    def _forget(self, block: int) -> None:
        name = self.names.pop(block, None)
        if name is not None and self._index.get(name) == block:
            del self._index[name]

    def reset(self) -> int:
        """Forget every name: cached blocks become free, held ones private to their
        holders (freed when they let go). Returns how many cached blocks were freed."""
        dropped = len(self._cached)
        self._free.extend(self._cached)
        self._cached.clear()
        self.names.clear()
        self._index.clear()
        return dropped

    def restore(self, holders: dict[int, int], names: dict[int, int]) -> None:
        """Rebuild from what a pool reports (a ledger that was lost): who holds which
        block, and which blocks hold named KV."""
        self.holders = dict(holders)
        self.names, self._index, self._cached = {}, {}, OrderedDict()
        for block, name in names.items():
            if self.caching and 0 <= block < self.num_blocks:
                self.name(block, name)
                if block not in self.holders:
                    self._cached[block] = None
        self._free = [b for b in range(self.num_blocks - 1, -1, -1) if b not in self.holders and b not in self.names]
