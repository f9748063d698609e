"""A paged KV cache: per-layer block pools shared by many sequences.

The decoder models take their past KV as dense ``[1, kv_heads, P, head_dim]`` tensors per
layer. Storing that densely per sequence would make every append a reallocation and every
speculative rewind a copy, and would not bound memory. Instead (vLLM style) every layer owns a
pool ``[num_blocks, kv_heads, block_size, head_dim]`` and every sequence owns a *block table*:
block ``b`` of a sequence holds ``block_size`` token slots in every layer. Layers may differ in
geometry (e.g. Gemma's sliding vs full layers), so each layer has its own pool arrays, but a
block id means the same token slots in all of them.

Sliding window with sink tokens (StreamingLLM): once a sequence retains more than
``sliding_window`` tokens, the oldest non-sink tokens are evicted so that what is retained is the
first ``sink_tokens`` tokens followed by the most recent ``sliding_window - sink_tokens``. No data
is moved: a sequence counts ``dropped`` evicted slots in *physical* slot space, so retained index
``r`` lives at physical slot ``r`` if ``r < sink_tokens`` else ``r + dropped``. A block whose slots
all lie in the evicted range ``[sink_tokens, sink_tokens + dropped)`` goes back to the free list
and its table entry becomes ``None`` (a hole).

Session-layout copies (``session_past`` / ``append_from_session``): gathering every
sequence's whole past out of the pools on every model call costs as much as a small
model's step. So the cache also keeps, per sequence, the dense per-layer tensors the
session itself returned last time (its ``present`` outputs), with a bool ``alive`` per
slot. The next call feeds them back as the past unchanged, and a rewind only marks the
rejected slots dead (the attention mask closes them), so neither a step nor a rewind
copies the past. The new tokens reach the pools lazily, when something reads the pools
(``materialize``, ``slice``) or the copy is dropped: one with too many dead slots is
written out and re-gathered from the pools on next use.

Prefix caching (``prefix_caching=True``, ``kv/prefix_cache.py``): a sequence's full
blocks of final KV are named by their tokens (``publish``) and stay in the pool after it
is freed, so a later sequence that starts with the same tokens holds the same blocks
(``share_prefix``) instead of computing them. Named blocks are immutable: their KV is in
the pools (``publish`` writes it out of the session's copy), no append writes below a
sequence's end, and a rewind into them is refused, so rewinds only ever touch a
sequence's private blocks. A named block no sequence holds is reused last (least
recently used first) when no free block is left. Not under a sliding window, whose
evictions would leave holes in a shared prefix.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np

from specserve.engine.errors import EngineError
from specserve.engine.kv.prefix_cache import ROOT_HASH, BlockPool, block_hashes, cacheable_blocks

__all__ = [
    "KVCacheCapacityError",
    "KVCacheError",
    "LayerGeometry",
    "PagedKVCache",
    "SessionPast",
    "UnknownSequenceError",
]


@dataclass(frozen=True)
class LayerGeometry:
    """Shape of one layer's KV: ``num_kv_heads`` heads of ``head_dim`` each."""

    num_kv_heads: int
    head_dim: int


class KVCacheError(EngineError):
    """Base class of every error the cache raises on purpose."""


class KVCacheCapacityError(KVCacheError):
    """Not enough free blocks for an append; the cache was left unchanged."""


class UnknownSequenceError(KVCacheError, KeyError):
    """The sequence id was never added, or has been freed."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


@dataclass
class _Seq:
    """Bookkeeping of one sequence: physical slots ``[0, end)``, minus ``dropped`` evicted ones."""

    table: list[int | None] = field(default_factory=list)
    end: int = 0
    dropped: int = 0
    reserved: list[int] | None = None  # blocks granted up front (by a KV manager), used in order
    session: "SessionPast | None" = None  # last dense past in the session's layout, see module docstring
    written: int = 0  # retained tokens whose KV is in the pools; the rest only in ``session``
    frozen: int = 0  # leading table blocks that are named (shared or published): immutable, never rewound
    chain: int = ROOT_HASH  # the name of block ``frozen - 1``, which the next one's chains to

    @property
    def length(self) -> int:
        return self.end - self.dropped


class SessionPast:
    """A sequence's past as the model session consumes it: per layer ``[1, heads, T, dim]``
    key/value tensors whose slot ``t`` is a real retained token iff ``alive[t]``. Dead
    slots (rejected drafts, batch padding) are closed by the attention mask."""

    __slots__ = ("_keys", "_values", "_alive", "slots", "buffer")

    def __init__(self, keys: list[np.ndarray] | None, values: list[np.ndarray] | None, alive: np.ndarray | None,
                 buffer: object | None = None, slots: int | None = None) -> None:
        self._keys, self._values = keys, values
        self._alive = alive  # bool [T]; None: all ``slots`` alive (made on first read)
        self.slots = alive.size if alive is not None else slots  # T
        # The preallocated buffer these tensors are views of, when an in-place call wrote
        # them (``engine.model.in_place``): its next call may write right after the live
        # slots. Its live slots are always a prefix (written all alive; a rewind only kills a tail).
        self.buffer = buffer

    @classmethod
    def in_buffer(cls, buffer: object, length: int) -> "SessionPast":
        """The first ``length`` slots of an in-place buffer (``buffer.keys``/``.values``,
        per layer ``[1, heads, capacity, dim]``), all alive. The per-layer views are made
        on first read: a decode step's copy is usually replaced by the next step's unread,
        and 32 views a step were a measurable share of the engine's time per token."""
        return cls(None, None, None, buffer, slots=length)

    @property
    def alive(self) -> np.ndarray:
        """Which slots are real (a rewind writes False into it)."""
        if self._alive is None:
            self._alive = np.ones(self.slots, np.bool_)
        return self._alive

    @property
    def keys(self) -> list[np.ndarray]:
        if self._keys is None:
            self._keys = [key[:, :, : self.slots] for key in self.buffer.keys]  # type: ignore[attr-defined]
        return self._keys

    @property
    def values(self) -> list[np.ndarray]:
        if self._values is None:
            self._values = [value[:, :, : self.slots] for value in self.buffer.values]  # type: ignore[attr-defined]
        return self._values

    @property
    def dead(self) -> int:
        return 0 if self._alive is None else int(self.slots - np.count_nonzero(self._alive))

    def live(self) -> slice | np.ndarray:
        """Index of the live slots along the slot axis, in order (a plain slice when no
        slot is dead, so taking them is a view, not a gather)."""
        return slice(None) if self._alive is None or self._alive.all() else np.flatnonzero(self._alive)


# Re-gather from the pools once dead slots are this many and this share of the copy:
# each dead slot costs attention compute on every later call.
MAX_DEAD_SLOTS, MAX_DEAD_SHARE = 32, 0.25


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


class PagedKVCache:
    """Paged storage of per-layer key/value tensors for many sequences (see module docstring)."""

    def __init__(
        self,
        layers: Sequence[LayerGeometry],
        num_blocks: int,
        block_size: int = 16,
        dtype: np.dtype = np.float32,
        sliding_window: int | None = None,
        sink_tokens: int = 0,
        prefix_caching: bool = False,
    ) -> None:
        self.layers: tuple[LayerGeometry, ...] = tuple(layers)
        if not self.layers:
            raise ValueError("layers must be non-empty")
        for i, g in enumerate(self.layers):
            if g.num_kv_heads <= 0 or g.head_dim <= 0:
                raise ValueError(f"layers[{i}] must have positive num_kv_heads and head_dim, got {g}")
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {sink_tokens}")
        if sliding_window is not None and sliding_window <= sink_tokens:
            raise ValueError(
                f"sliding_window must be None or > sink_tokens ({sink_tokens}), got {sliding_window}")
        if prefix_caching and sliding_window is not None:
            raise ValueError("prefix caching needs a full-attention KV cache: a sliding window evicts tokens from the "
                             "middle of a sequence, which would leave holes in a shared prefix")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = np.dtype(dtype)
        self.sliding_window = sliding_window
        self.sink_tokens = sink_tokens
        self._key_pools = [self._new_pool(g) for g in self.layers]
        self._value_pools = [self._new_pool(g) for g in self.layers]
        self._blocks = BlockPool(num_blocks, caching=prefix_caching)  # free, cached and held block ids
        self._seqs: dict[Hashable, _Seq] = {}

    def _new_pool(self, g: LayerGeometry) -> np.ndarray:
        return np.zeros((self.num_blocks, g.num_kv_heads, self.block_size, g.head_dim), self.dtype)

    # ------------------------------------------------------------------ sequences

    def add_sequence(self, seq_id: Hashable, reserved: Sequence[int] | None = None) -> None:
        """Register an empty sequence; it owns no blocks until its first append.

        ``reserved``: physical block ids granted to this sequence by an outside allocator
        (the distributed KV manager), each free or cached (a cached one is evicted: the
        allocator reuses it). They leave the free list now; the sequence's appends
        use them in order and only them, and rewinds hand them back to the reservation, so
        its block table is always a prefix of the grant and other sequences can never
        take them. Under a sliding window, blocks the window evicts go back to the grant too,
        so a grant of the window's worst case suffices. Freeing the sequence returns them to
        the pool.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        if reserved is None:
            self._seqs[seq_id] = _Seq()
            return
        reserved = [int(b) for b in reserved]
        try:
            self._blocks.take_these(reserved)
        except ValueError:
            taken = [b for b in reserved if not self._blocks.is_available(b)]
            raise KVCacheCapacityError(f"sequence {seq_id!r}: reserved blocks {taken or reserved} are not all "
                                       "free and distinct; the reservation disagrees with this pool") from None
        self._seqs[seq_id] = _Seq(reserved=reserved)

    def has_sequence(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def sequences(self) -> list:
        return list(self._seqs)

    @property
    def sequence_count(self) -> int:
        return len(self._seqs)

    def _get(self, seq_id: Hashable) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(f"unknown sequence {seq_id!r}") from None

    def length(self, seq_id: Hashable) -> int:
        """Tokens currently retained (what ``materialize`` returns), after any eviction."""
        return self._get(seq_id).length

    def dropped_tokens(self, seq_id: Hashable) -> int:
        """Tokens evicted by the window so far, so callers can keep absolute position ids."""
        return self._get(seq_id).dropped

    def block_table(self, seq_id: Hashable) -> list[int | None]:
        """Physical block ids of the sequence, ``None`` where an evicted block was freed."""
        return list(self._get(seq_id).table)

    def owned_blocks(self, seq_id: Hashable) -> list[int]:
        """Every block the sequence holds: its table, then what is left of its reservation."""
        s = self._get(seq_id)
        return [b for b in s.table if b is not None] + list(s.reserved or ())

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation can take: free ones and cached ones no sequence holds."""
        return self._blocks.available

    @property
    def used_blocks(self) -> int:
        """Blocks some sequence holds (a shared block counts once)."""
        return self.num_blocks - self._blocks.available

    # ------------------------------------------------------------------ prefix caching

    @property
    def prefix_caching(self) -> bool:
        return self._blocks.caching

    @property
    def cached_blocks(self) -> int:
        """Named blocks no sequence holds: kept for later prompts, counted in ``free_blocks``."""
        return self._blocks.cached

    def block_names(self) -> dict[int, int]:
        """Block -> the name of the full block of KV it holds (``kv.prefix_cache``), for a
        ledger that rebuilds its view of this pool."""
        return dict(self._blocks.names)

    def frozen_tokens(self, seq_id: Hashable) -> int:
        """Leading tokens of the sequence in named blocks: a rewind may not go below them."""
        return self._get(seq_id).frozen * self.block_size

    def share_prefix(self, seq_id: Hashable, tokens: Sequence[int], blocks: Sequence[int] | None = None) -> int:
        """Start the empty sequence on cached blocks holding the leading full blocks of
        ``tokens`` (what its prefill would feed); returns how many tokens they cover, whose
        KV need not be fed. At most ``cacheable_blocks(len(tokens))``: the last token is
        always fed. ``blocks``: the ones a ledger granted as cached (each must hold its
        block of ``tokens`` here, or this raises and changes nothing); None: the longest
        prefix this pool holds."""
        s = self._get(seq_id)
        if s.end or s.table:
            raise ValueError(f"sequence {seq_id!r} already holds KV; only an empty sequence starts on a cached prefix")
        if not self.prefix_caching:
            if blocks:
                raise KVCacheError(f"sequence {seq_id!r}: this pool caches no prefixes, so it has no blocks to share")
            return 0
        limit = cacheable_blocks(len(tokens), self.block_size)
        names = block_hashes(tokens, self.block_size, count=limit)
        if blocks is None:
            blocks = self._blocks.lookup(names)
        else:
            blocks = [int(b) for b in blocks]
            wrong = [b for b, name in zip(blocks, names) if not self._blocks.holds(b, name)]
            if len(blocks) > limit or wrong:
                raise KVCacheError(f"sequence {seq_id!r}: blocks {wrong or blocks} do not hold the KV of its first "
                                   f"{len(blocks) * self.block_size} tokens in this pool; the ledger and the pool "
                                   "disagree")
        for block in blocks:
            self._blocks.share(block)
        s.table, s.frozen = list(blocks), len(blocks)
        s.end = s.written = len(blocks) * self.block_size
        s.chain = names[len(blocks) - 1] if blocks else ROOT_HASH
        return s.end

    def publish(self, seq_id: Hashable, tokens: Sequence[int]) -> int:
        """``tokens`` are the sequence's first tokens and their KV is final (committed: no
        later rewind goes below them). Name each full block among them, so that later
        prompts starting with the same tokens share it; from now on it is immutable (its
        KV is written to the pools now, and a rewind into it is refused). Returns how many
        leading blocks are named."""
        s = self._get(seq_id)
        full = min(len(tokens), s.length) // self.block_size
        if not self.prefix_caching or full <= s.frozen:
            return s.frozen
        self._flush(s)  # whoever shares these blocks reads them from the pools
        names = block_hashes(tokens, self.block_size, s.chain, s.frozen, full - s.frozen)
        for index, name in zip(range(s.frozen, full), names):
            self._blocks.name(s.table[index], name)
        s.frozen, s.chain = full, names[-1]
        return full

    def reset_prefix_cache(self) -> int:
        """Forget every named block (vLLM's ``reset_prefix_cache``): cached ones become
        free, shared ones stay with their holders until they let go. Returns the cached
        blocks freed."""
        return self._blocks.reset()

    # ------------------------------------------------------------------ window geometry

    def _window_dropped(self, length: int, dropped: int) -> int:
        """``dropped`` after applying the window to a sequence that retains ``length`` tokens."""
        if self.sliding_window is None or length <= self.sliding_window:
            return dropped
        return dropped + (length - self.sliding_window)

    def _dead_blocks(self, dropped: int) -> range:
        """Table indices whose slots all lie in the evicted range ``[sink, sink + dropped)``."""
        return range(_ceil_div(self.sink_tokens, self.block_size),
                     (self.sink_tokens + dropped) // self.block_size)

    def _plan_append(self, s: _Seq, n: int) -> _AppendPlan:
        end = s.end + n
        if self.sliding_window is None and s.dropped == 0:
            # Nothing is ever evicted: only the whole blocks past the table (a decode step
            # plans twice; the general rule below was the largest part of its Python).
            return _AppendPlan(end, 0, tuple(range(len(s.table), _ceil_div(end, self.block_size))), 0)
        dropped = self._window_dropped(end - s.dropped, s.dropped)
        dead = self._dead_blocks(dropped)
        reclaim = sum(1 for b in self._newly_dead(s, dropped) if b < len(s.table) and s.table[b] is not None)
        allocate = tuple(b for b in range(len(s.table), _ceil_div(end, self.block_size)) if b not in dead)
        return _AppendPlan(end=end, dropped=dropped, allocate=allocate, reclaim=reclaim)

    def _newly_dead(self, s: _Seq, dropped: int) -> range:
        """Blocks that become dead when ``s.dropped`` grows to ``dropped``.

        Invariant: every block dead under ``s.dropped`` is already a hole, so only the blocks
        between the old and the new dead boundary need looking at (O(new holes), not O(length)).
        """
        old, new = self._dead_blocks(s.dropped), self._dead_blocks(dropped)
        return range(max(old.stop, new.start), new.stop)

    def blocks_needed(self, seq_id: Hashable, extra_tokens: int) -> int:
        """Net new blocks an append of ``extra_tokens`` needs, for admission control.

        Blocks that the append's own window eviction would free are netted off, so
        ``append`` succeeds exactly when ``blocks_needed(...) <= free_blocks``. A sequence
        with a reservation needs 0 pool blocks, or raises ``KVCacheCapacityError`` when
        the append would outgrow its grant.
        """
        if extra_tokens < 0:
            raise ValueError(f"extra_tokens must be >= 0, got {extra_tokens}")
        s = self._get(seq_id)
        needed = self._plan_append(s, extra_tokens).net_blocks
        if s.reserved is None:
            return needed
        if needed > len(s.reserved):  # a reserved sequence draws from its grant, never the pool
            raise KVCacheCapacityError(f"sequence {seq_id!r} needs {needed} more block(s) but only "
                                       f"{len(s.reserved)} of its reserved blocks are left")
        return 0

    # ------------------------------------------------------------------ mutation

    def _release(self, s: _Seq, indices: Sequence[int] | range) -> None:
        returned = []
        for b in indices:
            block = s.table[b]
            if block is not None:
                returned.append(block)
                s.table[b] = None
        if s.reserved is not None:
            s.reserved[:0] = returned  # back to the front of the grant, in table order
        else:
            for block in returned:
                self._blocks.drop(block)

    def apply_sliding_window(self, seq_id: Hashable) -> None:
        """Evict the oldest non-sink tokens beyond the window and free blocks left empty.

        ``append`` calls this itself; calling it again is a no-op.
        """
        s = self._get(seq_id)
        dropped = self._window_dropped(s.length, s.dropped)
        if dropped != s.dropped:
            newly_dead = self._newly_dead(s, dropped)
            s.dropped, s.session = dropped, None  # append_from_session refuses windows: nothing pending
            self._release(s, newly_dead)

    def append(self, seq_id: Hashable, keys: Sequence[np.ndarray], values: Sequence[np.ndarray]) -> None:
        """Append ``n`` tokens of KV to every layer, then apply the sliding window.

        ``keys[l]`` and ``values[l]`` are ``[kv_heads_l, n, head_dim_l]`` or with a leading batch
        axis of 1. Atomic: on any error (bad shapes, not enough blocks) nothing changes.
        """
        s = self._get(seq_id)
        keys, values, n = self._check_kv(keys, values)
        self._flush(s)
        old_end = self._allocate(seq_id, s, n)
        s.session = None
        # Write only the new tokens that survived the eviction (some may be evicted at once).
        slots = np.arange(old_end, s.end)
        alive = (slots < self.sink_tokens) | (slots >= self.sink_tokens + s.dropped)
        self._write(s, slots[alive], [k[:, alive] for k in keys], [v[:, alive] for v in values])
        s.written = s.length

    def append_from_session(self, seq_id: Hashable, keys: Sequence[np.ndarray], values: Sequence[np.ndarray],
                            alive: np.ndarray) -> None:
        """Append the new tokens of a model call given the session's whole output: per layer
        ``present`` tensors ``[1, heads, T, dim]`` (the past fed plus the new tokens) and
        which of their ``T`` slots are real. That output becomes the sequence's past for
        the next call (``session_past``); the pools get the new tokens' data only when
        something reads them (``materialize``, ``slice``), so a step copies nothing.

        Atomic like ``append``. Not under a sliding window, whose evictions the session's
        copy cannot follow: use ``append`` there. (An in-place call's buffer goes through
        ``append_in_buffer``.)
        """
        if self.sliding_window is not None:
            raise ValueError("append_from_session needs a cache without a sliding window; use append")
        s = self._get(seq_id)
        alive = np.asarray(alive, np.bool_)
        n = int(np.count_nonzero(alive)) - s.length
        if n < 1:
            raise ValueError(f"the session output holds {n + s.length} live slots; sequence {seq_id!r} "
                             f"already retains {s.length}, so there is nothing new to append")
        shapes = [(1, g.num_kv_heads, alive.size, g.head_dim) for g in self.layers]
        if [a.shape for a in keys] != shapes or [a.shape for a in values] != shapes:
            raise ValueError(f"session output must be one [1, heads, {alive.size}, dim] tensor per layer "
                             f"matching the cache geometry")
        self._allocate(seq_id, s, n)
        s.session = SessionPast(list(keys), list(values), alive)

    def append_in_buffer(self, seq_id: Hashable, buffer: object, length: int) -> None:
        """``append_from_session`` for an in-place call: the first ``length`` slots of
        ``buffer`` (``engine.model.in_place.KVBuffer``) are the sequence's whole retained
        past, all alive, and become its session copy. Atomic like ``append``."""
        if self.sliding_window is not None:
            raise ValueError("append_in_buffer needs a cache without a sliding window; use append")
        s = self._get(seq_id)
        n = length - s.length
        if n < 1:
            raise ValueError(f"the buffer holds {length} live slots; sequence {seq_id!r} already retains "
                             f"{s.length}, so there is nothing new to append")
        keys = buffer.keys  # type: ignore[attr-defined]
        first = self.layers[0]
        if len(keys) != len(self.layers) or keys[0].shape[1] != first.num_kv_heads \
                or keys[0].shape[3] != first.head_dim or keys[0].shape[2] < length:
            raise ValueError(f"the buffer must hold {length} slots in one [1, heads, capacity, dim] tensor per "
                             f"layer matching the cache geometry")
        self._allocate(seq_id, s, n)
        s.session = SessionPast.in_buffer(buffer, length)

    def _allocate(self, seq_id: Hashable, s: _Seq, n: int) -> int:
        """Give the sequence ``n`` more token slots (and blocks), applying the window;
        returns the old physical end. Raises before changing anything if they do not fit."""
        plan = self._plan_append(s, n)
        # A reserved sequence draws from its grant; blocks its own window eviction frees go
        # back to the grant before the new ones are taken, so only the net count must fit.
        if s.reserved is not None and plan.net_blocks > len(s.reserved):
            raise KVCacheCapacityError(
                f"sequence {seq_id!r} needs {plan.net_blocks} more block(s) to append {n} token(s) "
                f"but only {len(s.reserved)} of its reserved blocks are left")
        if s.reserved is None and plan.net_blocks > self._blocks.available:
            raise KVCacheCapacityError(
                f"sequence {seq_id!r} needs {plan.net_blocks} more block(s) to append {n} token(s) "
                f"but only {self._blocks.available} of {self.num_blocks} are free")
        old_end = s.end
        # Grow the table with holes first, evict (which frees blocks), then fill the live holes:
        # eviction before allocation is what lets a full pool keep decoding under a window.
        s.table.extend([None] * (_ceil_div(plan.end, self.block_size) - len(s.table)))
        s.end = plan.end
        self.apply_sliding_window(seq_id)
        for b in plan.allocate:
            s.table[b] = self._blocks.take(1)[0] if s.reserved is None else s.reserved.pop(0)
        return old_end

    def _write(self, s: _Seq, slots: np.ndarray, keys: Sequence[np.ndarray], values: Sequence[np.ndarray]) -> None:
        """Store per-layer ``[heads, len(slots), dim]`` data at physical ``slots``."""
        if not slots.size:
            return
        table = np.asarray([-1 if b is None else b for b in s.table])
        blocks, offsets = table[slots // self.block_size], slots % self.block_size
        for pools, arrays in ((self._key_pools, keys), (self._value_pools, values)):
            for pool, arr in zip(pools, arrays):
                # pool[blocks, :, offsets, :] has shape [k, heads, head_dim].
                pool[blocks, :, offsets, :] = arr.transpose(1, 0, 2)

    def _flush(self, s: _Seq) -> None:
        """Write tokens that so far live only in the session's copy into the pools (no
        window when any are pending, so logical index = physical slot)."""
        if s.written >= s.length:
            return
        assert s.session is not None, "pending KV without the session copy that holds it"
        live = np.flatnonzero(s.session.alive)[s.written : s.length]
        self._write(s, np.arange(s.written, s.length), [k[0][:, live] for k in s.session.keys],
                    [v[0][:, live] for v in s.session.values])
        s.written = s.length

    def _check_kv(self, keys: Sequence[np.ndarray], values: Sequence[np.ndarray]
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

    def rewind(self, seq_id: Hashable, length: int) -> None:
        """Keep the first ``length`` retained tokens (e.g. drop rejected draft tokens).

        Rewinding into the sink tokens makes the evicted gap irrelevant, so ``dropped`` resets
        to 0. Blocks wholly past the new physical end are freed; holes stay holes. A rewind
        below the sequence's named (shared) blocks is refused: they are immutable.
        """
        s = self._get(seq_id)
        if not 0 <= length <= s.length:
            raise ValueError(f"rewind length must be in [0, {s.length}] for sequence {seq_id!r}, got {length}")
        if length < s.frozen * self.block_size:
            raise KVCacheError(f"sequence {seq_id!r} cannot rewind to {length} tokens: its first "
                               f"{s.frozen * self.block_size} are in shared (named) blocks, which are immutable")
        if s.session is not None and length < s.length:
            alive_slots = np.flatnonzero(s.session.alive)
            s.session.alive[alive_slots[length:]] = False
        s.written = min(s.written, length)
        if length < self.sink_tokens or s.dropped == 0:
            s.dropped, s.end = 0, length
        else:
            s.end = length + s.dropped
        keep = _ceil_div(s.end, self.block_size)
        self._release(s, range(keep, len(s.table)))
        del s.table[keep:]

    def free(self, seq_id: Hashable) -> None:
        """Release all blocks of the sequence and forget it. Its named blocks stay cached
        (held by any other sequence that shares them, else reusable by later prompts)."""
        s = self._get(seq_id)
        for block in [b for b in s.table if b is not None] + list(s.reserved or ()):
            self._blocks.drop(block)
        del self._seqs[seq_id]

    # ------------------------------------------------------------------ reading

    def _segments(self, s: _Seq) -> list[tuple[int, int]]:
        """Retained tokens as contiguous physical slot ranges: sinks, then the recent tail."""
        if s.dropped == 0:
            ranges = [(0, s.end)]
        else:
            ranges = [(0, self.sink_tokens), (self.sink_tokens + s.dropped, s.end)]
        return [(a, b) for a, b in ranges if b > a]

    def _gather(self, pool: np.ndarray, s: _Seq, segments: list[tuple[int, int]]) -> np.ndarray:
        """Dense ``[1, heads, length, dim]`` copy, gathering whole blocks per segment."""
        _, heads, bs, dim = pool.shape
        parts = []
        for start, stop in segments:
            first, last = start // bs, _ceil_div(stop, bs)
            ids = s.table[first:last]
            blocks = pool[ids]  # [nb, heads, bs, dim]; ids are never None inside a segment
            flat = blocks.transpose(1, 0, 2, 3).reshape(heads, len(ids) * bs, dim)
            parts.append(flat[:, start - first * bs: stop - first * bs])
        if not parts:
            return np.zeros((1, heads, 0, dim), self.dtype)
        return np.ascontiguousarray(np.concatenate(parts, axis=1)[None])

    def materialize(self, seq_id: Hashable) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per layer dense ``(key, value)``, each ``[1, kv_heads_l, length, head_dim_l]`` (copies)."""
        s = self._get(seq_id)
        self._flush(s)
        segs = self._segments(s)
        return [(self._gather(k, s, segs), self._gather(v, s, segs))
                for k, v in zip(self._key_pools, self._value_pools)]

    def session_past(self, seq_id: Hashable, compact: bool = True) -> SessionPast:
        """The sequence's past in the session's layout, possibly with dead slots: the copy
        kept from the last call, or a fresh gather from the pools (see module docstring).
        ``compact=False`` keeps a copy however many slots are dead (a caller that copies the
        live slots out anyway). Callers must not write into the returned tensors."""
        s = self._get(seq_id)
        kept = s.session
        if compact and kept is not None and kept.dead >= MAX_DEAD_SLOTS \
                and kept.dead >= MAX_DEAD_SHARE * kept.alive.size:
            kept = None
        if kept is None:
            kept = s.session = self.gathered_past(seq_id)  # writes pending tokens out of the old copy first
        return kept

    def read_into(self, seq_id: Hashable, keys: Sequence[np.ndarray], values: Sequence[np.ndarray]) -> None:
        """Copy the retained past into slots ``[0, length)`` of per-layer ``[1, heads, C,
        dim]`` arrays (an in-place buffer), straight from the pools: one copy, where
        ``gathered_past`` and copying its result would make several (a sequence that
        starts on a long cached prefix reads it so). Not under a window (no holes)."""
        s = self._get(seq_id)
        if s.dropped:
            raise ValueError("read_into needs a sequence with nothing evicted")
        self._flush(s)
        full, tail = divmod(s.length, self.block_size)
        ids = np.asarray(s.table[:full], np.intp)
        for pools, arrays in ((self._key_pools, keys), (self._value_pools, values)):
            for pool, array in zip(pools, arrays):
                _, heads, _, dim = pool.shape
                if full:  # the destination's first ``full`` blocks of slots, viewed block by block
                    blocks = array[0, :, : full * self.block_size].reshape(heads, full, self.block_size, dim)
                    np.take(pool, ids, axis=0, out=blocks.transpose(1, 0, 2, 3), mode="clip")
                if tail:
                    array[0, :, full * self.block_size: s.length] = pool[s.table[full], :, :tail]

    def copy_past_into(self, seq_id: Hashable, keys: Sequence[np.ndarray], values: Sequence[np.ndarray]) -> None:
        """Copy the retained past into slots ``[0, length)`` of per-layer ``[1, heads, C,
        dim]`` arrays (a new in-place buffer): from the session copy's live slots where
        the cache keeps one, else from the pools (``read_into``)."""
        past = self._get(seq_id).session
        if past is None:
            self.read_into(seq_id, keys, values)
            return
        length, live = self.length(seq_id), past.live()
        for layer, (key, value) in enumerate(zip(past.keys, past.values)):
            keys[layer][:, :, :length] = key[:, :, live]
            values[layer][:, :, :length] = value[:, :, live]

    def kept_session(self, seq_id: Hashable) -> SessionPast | None:
        """The session-layout copy the cache holds for the sequence now (no gather), or
        None; callers compare it by identity to know whether a copy is still current."""
        return self._get(seq_id).session

    def gathered_past(self, seq_id: Hashable) -> SessionPast:
        """A fresh dense copy of the retained past (no dead slots), gathered from the pools."""
        layers = self.materialize(seq_id)
        return SessionPast([k for k, _ in layers], [v for _, v in layers], np.ones(self.length(seq_id), np.bool_))

    def slice(self, seq_id: Hashable, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """One layer's dense ``(key, value)``, each ``[1, kv_heads_l, length, head_dim_l]``.

        Read only. From an in-place buffer (``engine.model.in_place``) they are views of
        its live prefix, not copies: later calls write only from the sequence's length on
        (a rewind shortens it; committed tokens' KV never changes), so the views keep
        showing this KV, and their one reader, the shared-KV head, copies them into its
        padded batch anyway: a copy here would be paid every round for nothing."""
        s = self._get(seq_id)
        if not 0 <= layer < len(self.layers):
            raise IndexError(f"layer {layer} out of range: the cache has {len(self.layers)} layers")
        if s.session is not None and s.session.buffer is not None:
            live = s.session.slots - s.session.dead  # a buffer's live slots are a prefix
            buffer = s.session.buffer
            views = buffer.keys[layer][:, :, :live], buffer.values[layer][:, :, :live]  # type: ignore[attr-defined]
            for view in views:
                view.flags.writeable = False  # a reader writing into it would write the KV
            return views
        if s.session is not None:
            # The session copy holds every retained token (pending ones too): copying one
            # layer's live slots out of it beats writing all layers' pending tokens to the
            # pools and gathering blocks back (a shared-KV head reads this every round).
            live = s.session.live()
            return (np.ascontiguousarray(s.session.keys[layer][:, :, live]),
                    np.ascontiguousarray(s.session.values[layer][:, :, live]))
        self._flush(s)
        segs = self._segments(s)
        return self._gather(self._key_pools[layer], s, segs), self._gather(self._value_pools[layer], s, segs)
