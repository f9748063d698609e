"""The pool of a paged KV cache: per-layer block arrays, each sequence's block table,
allocation (from the pool or a sequence's reserved grant) and the sliding window.

Every layer owns a pool ``[num_blocks, kv_heads, block_size, head_dim]`` and every sequence
a *block table*: block ``b`` of a sequence holds ``block_size`` token slots in every layer.
Layers may differ in geometry (e.g. Gemma's sliding vs full layers), so each layer has its
own pool arrays, but a block id means the same token slots in all of them.

Sliding window with sink tokens (StreamingLLM): once a sequence retains more than
``sliding_window`` tokens, the oldest non-sink tokens are evicted so that what is retained is the
first ``sink_tokens`` tokens followed by the most recent ``sliding_window - sink_tokens``. No data
is moved: a sequence counts ``dropped`` evicted slots in *physical* slot space, so retained index
``r`` lives at physical slot ``r`` if ``r < sink_tokens`` else ``r + dropped``. A block whose slots
all lie in the evicted range ``[sink_tokens, sink_tokens + dropped)`` goes back to the free list
and its table entry becomes ``None`` (a hole).

This module knows slots and blocks, never what a sequence's calls read: that is the
sequence's session copy (``kv/session_past.py``), which the owner of both
(``kv/paged_cache.py``) writes out here when something needs the pools.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np

from specserve.engine.kv.block_pool import BlockPool
from specserve.engine.kv.errors import KVCacheCapacityError


@dataclass(frozen=True)
class LayerGeometry:
    """Shape of one layer's KV: ``num_kv_heads`` heads of ``head_dim`` each."""

    num_kv_heads: int
    head_dim: int


@dataclass
class BlockTable:
    """One sequence's blocks: physical slots ``[0, end)``, minus ``dropped`` evicted ones."""

    table: list[int | None] = field(default_factory=list)
    end: int = 0
    dropped: int = 0
    reserved: list[int] | None = None  # blocks granted up front (by a KV manager), used in order

    @property
    def length(self) -> int:
        return self.end - self.dropped

    def blocks(self) -> list[int]:
        """Every block it holds: its table, then what is left of its reservation."""
        return [b for b in self.table if b is not None] + list(self.reserved or ())


@dataclass(frozen=True)
class _AppendPlan:
    """What an append of ``n`` tokens would do, computed before anything is mutated."""

    end: int                 # physical end after the append
    dropped: int             # evicted count after the append (window applied)
    allocate: tuple[int, ...]  # new table indices that need a physical block
    reclaim: int             # existing blocks the window eviction would free

    @property
    def net_blocks(self) -> int:
        return max(0, len(self.allocate) - self.reclaim)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockTables:
    """The pools, the block ids' states (``BlockPool``) and the window geometry; every
    method takes the sequence's ``BlockTable``."""

    def __init__(self, layers: Sequence[LayerGeometry], num_blocks: int, block_size: int, dtype: np.dtype,
                 sliding_window: int | None, sink_tokens: int, prefix_caching: bool) -> None:
        self.layers = tuple(layers)
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, np.dtype(dtype)
        self.sliding_window, self.sink_tokens = sliding_window, sink_tokens
        self.key_pools = [self._new_pool(g) for g in self.layers]
        self.value_pools = [self._new_pool(g) for g in self.layers]
        self.blocks = BlockPool(num_blocks, caching=prefix_caching)  # free, cached and held block ids

    def _new_pool(self, g: LayerGeometry) -> np.ndarray:
        return np.zeros((self.num_blocks, g.num_kv_heads, self.block_size, g.head_dim), self.dtype)

    # -- sequences ---------------------------------------------------------------------
    def new_table(self, seq_id: Hashable, reserved: Sequence[int] | None) -> BlockTable:
        """An empty table; ``reserved``: block ids granted to it up front, each free or
        cached (a cached one is evicted), which leave the free list now."""
        if reserved is None:
            return BlockTable()
        reserved = [int(b) for b in reserved]
        try:
            self.blocks.take_these(reserved)
        except ValueError:
            taken = [b for b in reserved if not self.blocks.is_available(b)]
            raise KVCacheCapacityError(f"sequence {seq_id!r}: reserved blocks {taken or reserved} are not all "
                                       "free and distinct; the reservation disagrees with this pool") from None
        return BlockTable(reserved=reserved)

    def start_on(self, t: BlockTable, blocks: Sequence[int]) -> None:
        """An empty table starts on ``blocks`` (already held for it), all slots full."""
        t.table = list(blocks)
        t.end = len(blocks) * self.block_size

    def release_all(self, t: BlockTable) -> None:
        for block in t.blocks():
            self.blocks.drop(block)

    # -- window geometry -----------------------------------------------------------------
    def _window_dropped(self, length: int, dropped: int) -> int:
        """``dropped`` after applying the window to a sequence that retains ``length`` tokens."""
        if self.sliding_window is None or length <= self.sliding_window:
            return dropped
        return dropped + (length - self.sliding_window)

    def _dead_blocks(self, dropped: int) -> range:
        """Table indices whose slots all lie in the evicted range ``[sink, sink + dropped)``."""
        return range(_ceil_div(self.sink_tokens, self.block_size),
                     (self.sink_tokens + dropped) // self.block_size)

    def _plan_append(self, t: BlockTable, n: int) -> _AppendPlan:
        end = t.end + n
        if self.sliding_window is None and t.dropped == 0:
            # Nothing is ever evicted: only the whole blocks past the table (a decode step
            # plans twice; the general rule below was the largest part of its Python).
            return _AppendPlan(end, 0, tuple(range(len(t.table), _ceil_div(end, self.block_size))), 0)
        dropped = self._window_dropped(end - t.dropped, t.dropped)
        dead = self._dead_blocks(dropped)
        reclaim = sum(1 for b in self._newly_dead(t, dropped) if b < len(t.table) and t.table[b] is not None)
        allocate = tuple(b for b in range(len(t.table), _ceil_div(end, self.block_size)) if b not in dead)
        return _AppendPlan(end=end, dropped=dropped, allocate=allocate, reclaim=reclaim)

    def _newly_dead(self, t: BlockTable, dropped: int) -> range:
        """Blocks that become dead when ``t.dropped`` grows to ``dropped``.

        Invariant: every block dead under ``t.dropped`` is already a hole, so only the blocks
        between the old and the new dead boundary need looking at (O(new holes), not O(length)).
        """
        old, new = self._dead_blocks(t.dropped), self._dead_blocks(dropped)
        return range(max(old.stop, new.start), new.stop)

    def blocks_needed(self, seq_id: Hashable, t: BlockTable, extra_tokens: int) -> int:
        """Net new pool blocks an append of ``extra_tokens`` needs (0 for a reserved
        sequence, which raises ``KVCacheCapacityError`` if it would outgrow its grant)."""
        needed = self._plan_append(t, extra_tokens).net_blocks
        if t.reserved is None:
            return needed
        if needed > len(t.reserved):  # a reserved sequence draws from its grant, never the pool
            raise KVCacheCapacityError(f"sequence {seq_id!r} needs {needed} more block(s) but only "
                                       f"{len(t.reserved)} of its reserved blocks are left")
        return 0

    # -- mutation ----------------------------------------------------------------------
    def _release(self, t: BlockTable, indices: Sequence[int] | range) -> None:
        returned = []
        for b in indices:
            block = t.table[b]
            if block is not None:
                returned.append(block)
                t.table[b] = None
        if t.reserved is not None:
            t.reserved[:0] = returned  # back to the front of the grant, in table order
        else:
            for block in returned:
                self.blocks.drop(block)

    def apply_window(self, t: BlockTable) -> bool:
        """Evict the oldest non-sink tokens beyond the window and free blocks left empty;
        whether anything was evicted."""
        dropped = self._window_dropped(t.length, t.dropped)
        if dropped == t.dropped:
            return False
        newly_dead = self._newly_dead(t, dropped)
        t.dropped = dropped
        self._release(t, newly_dead)
        return True

    def allocate(self, seq_id: Hashable, t: BlockTable, n: int) -> int:
        """Give the sequence ``n`` more token slots (and blocks), applying the window;
        returns the old physical end. Raises before changing anything if they do not fit."""
        plan = self._plan_append(t, n)
        # A reserved sequence draws from its grant; blocks its own window eviction frees go
        # back to the grant before the new ones are taken, so only the net count must fit.
        if t.reserved is not None and plan.net_blocks > len(t.reserved):
            raise KVCacheCapacityError(
                f"sequence {seq_id!r} needs {plan.net_blocks} more block(s) to append {n} token(s) "
                f"but only {len(t.reserved)} of its reserved blocks are left")
        if t.reserved is None and plan.net_blocks > self.blocks.available:
            raise KVCacheCapacityError(
                f"sequence {seq_id!r} needs {plan.net_blocks} more block(s) to append {n} token(s) "
                f"but only {self.blocks.available} of {self.num_blocks} are free")
        old_end = t.end
        # Grow the table with holes first, evict (which frees blocks), then fill the live holes:
        # eviction before allocation is what lets a full pool keep decoding under a window.
        t.table.extend([None] * (_ceil_div(plan.end, self.block_size) - len(t.table)))
        t.end = plan.end
        self.apply_window(t)
        for b in plan.allocate:
            t.table[b] = self.blocks.take(1)[0] if t.reserved is None else t.reserved.pop(0)
        return old_end

    def truncate(self, t: BlockTable, length: int) -> None:
        """Keep the first ``length`` retained tokens' slots. Rewinding into the sink tokens
        makes the evicted gap irrelevant, so ``dropped`` resets to 0. Blocks wholly past the
        new physical end are freed; holes stay holes."""
        if length < self.sink_tokens or t.dropped == 0:
            t.dropped, t.end = 0, length
        else:
            t.end = length + t.dropped
        keep = _ceil_div(t.end, self.block_size)
        self._release(t, range(keep, len(t.table)))
        del t.table[keep:]

    def _places(self, t: BlockTable, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The block id and offset of each physical slot."""
        table = np.asarray([-1 if b is None else b for b in t.table])
        return table[slots // self.block_size], slots % self.block_size

    def write(self, t: BlockTable, slots: np.ndarray, keys: Sequence[np.ndarray], values: Sequence[np.ndarray]) -> None:
        """Store per-layer ``[heads, len(slots), dim]`` data at physical ``slots``."""
        if not slots.size:
            return
        blocks, offsets = self._places(t, slots)
        for pools, arrays in ((self.key_pools, keys), (self.value_pools, values)):
            for pool, arr in zip(pools, arrays):
                # pool[blocks, :, offsets, :] has shape [k, heads, head_dim].
                pool[blocks, :, offsets, :] = arr.transpose(1, 0, 2)

    def move(self, t: BlockTable, source: np.ndarray, first: int) -> None:
        """Copy the KV at physical ``source`` slots to slots ``first, first + 1, ...``
        (later than or at each source's own place: a rewind that keeps a tree path)."""
        if not source.size:
            return
        src_blocks, src_offsets = self._places(t, source)
        dst_blocks, dst_offsets = self._places(t, np.arange(first, first + source.size))
        for pool in (*self.key_pools, *self.value_pools):
            pool[dst_blocks, :, dst_offsets, :] = pool[src_blocks, :, src_offsets, :]

    def check_kv(self, keys: Sequence[np.ndarray], values: Sequence[np.ndarray]
                 ) -> tuple[list[np.ndarray], list[np.ndarray], int]:
        """Validate per-layer shapes; return 3-d ``[heads, n, dim]`` views and ``n``."""
        if len(keys) != len(self.layers) or len(values) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} layers of keys and values, "
                             f"got {len(keys)} keys and {len(values)} values")
        n: int | None = None
        out: dict[str, list[np.ndarray]] = {"keys": [], "values": []}
        for name, arrays in (("keys", keys), ("values", values)):
            for i, (arr, g) in enumerate(zip(arrays, self.layers)):
                arr = np.asarray(arr, dtype=self.dtype)  # cast now so a bad dtype fails before any mutation
                if arr.ndim == 4 and arr.shape[0] == 1:
                    arr = arr[0]
                expected = (g.num_kv_heads, n if n is not None else "n", g.head_dim)
                if arr.ndim != 3 or arr.shape[0] != g.num_kv_heads or arr.shape[2] != g.head_dim \
                        or (n is not None and arr.shape[1] != n):
                    raise ValueError(f"layer {i} {name}: expected shape [1,] {expected}, "
                                     f"got {tuple(np.shape(arrays[i]))}")
                if n is None:
                    n = arr.shape[1]
                    if n < 1:
                        raise ValueError(f"layer {i} {name}: need at least one token, got n=0")
                out[name].append(arr)
        assert n is not None
        return out["keys"], out["values"], n

    # -- reading -----------------------------------------------------------------------
    def _segments(self, t: BlockTable) -> list[tuple[int, int]]:
        """Retained tokens as contiguous physical slot ranges: sinks, then the recent tail."""
        if t.dropped == 0:
            ranges = [(0, t.end)]
        else:
            ranges = [(0, self.sink_tokens), (self.sink_tokens + t.dropped, t.end)]
        return [(a, b) for a, b in ranges if b > a]

    def _gather(self, pool: np.ndarray, t: BlockTable, segments: list[tuple[int, int]]) -> np.ndarray:
        """Dense ``[1, heads, length, dim]`` copy, gathering whole blocks per segment."""
        _, heads, bs, dim = pool.shape
        parts = []
        for start, stop in segments:
            first, last = start // bs, _ceil_div(stop, bs)
            ids = t.table[first:last]
            blocks = pool[ids]  # [nb, heads, bs, dim]; ids are never None inside a segment
            flat = blocks.transpose(1, 0, 2, 3).reshape(heads, len(ids) * bs, dim)
            parts.append(flat[:, start - first * bs: stop - first * bs])
        if not parts:
            return np.zeros((1, heads, 0, dim), self.dtype)
        return np.ascontiguousarray(np.concatenate(parts, axis=1)[None])

    def gather(self, t: BlockTable) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per layer dense ``(key, value)`` copies of the retained slots."""
        segs = self._segments(t)
        return [(self._gather(k, t, segs), self._gather(v, t, segs)) for k, v in zip(self.key_pools, self.value_pools)]

    def gather_layer(self, t: BlockTable, layer: int) -> tuple[np.ndarray, np.ndarray]:
        segs = self._segments(t)
        return self._gather(self.key_pools[layer], t, segs), self._gather(self.value_pools[layer], t, segs)

    def read_into(self, t: BlockTable, keys: Sequence[np.ndarray], values: Sequence[np.ndarray]) -> None:
        """Copy the retained slots (nothing evicted) into slots ``[0, length)`` of per-layer
        ``[1, heads, C, dim]`` arrays, block by block: one copy."""
        full, tail = divmod(t.length, self.block_size)
        ids = np.asarray(t.table[:full], np.intp)
        for pools, arrays in ((self.key_pools, keys), (self.value_pools, values)):
            for pool, array in zip(pools, arrays):
                _, heads, _, dim = pool.shape
                if full:  # the destination's first ``full`` blocks of slots, viewed block by block
                    blocks = array[0, :, : full * self.block_size].reshape(heads, full, self.block_size, dim)
                    np.take(pool, ids, axis=0, out=blocks.transpose(1, 0, 2, 3), mode="clip")
                if tail:
                    array[0, :, full * self.block_size: t.length] = pool[t.table[full], :, :tail]
