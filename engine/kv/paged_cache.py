"""A paged KV cache: per-layer block pools shared by many sequences, and the one owner of
each sequence's KV.

The decoder models take their past KV as dense ``[1, kv_heads, P, head_dim]`` tensors per
layer. Storing that densely per sequence would make every append a reallocation and every
speculative rewind a copy, and would not bound memory. Instead (vLLM style) the KV lives in
block pools, and ``PagedKVCache`` puts three jobs together for each sequence, each in its
own module:

- **the pool** (``kv/block_tables.py``): its block table, allocation from the pool or its
  reserved grant, the sliding window with sinks, and reading and writing slots;
- **the session copy** (``kv/session_past.py``): the past in the layout the model calls
  read and write, whose new tokens reach the pools lazily;
- **prefix sharing** (``kv/prefix_sharing.py``): naming its final blocks, and starting it
  on blocks that hold its prompt's leading tokens.

Appends, reads and the rewind go through here, so the three stay consistent: the rewind,
for a chain of drafts or a token tree's path, is ``rewind`` and nothing else.
"""
from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

from specserve.engine.kv.block_tables import BlockTable, BlockTables, LayerGeometry
from specserve.engine.kv.errors import KVCacheCapacityError, KVCacheError, UnknownSequenceError
from specserve.engine.kv.prefix_sharing import PrefixSharing, SharedPrefix
from specserve.engine.kv.session_past import KeptPast, SessionPast

__all__ = [
    "KVCacheCapacityError",
    "KVCacheError",
    "LayerGeometry",
    "PagedKVCache",
    "SessionPast",
    "UnknownSequenceError",
]


class _Seq:
    """One sequence's three parts."""

    __slots__ = ("blocks", "kept", "prefix")

    def __init__(self, blocks: BlockTable) -> None:
        self.blocks, self.kept, self.prefix = blocks, KeptPast(), SharedPrefix()

    @property
    def length(self) -> int:
        return self.blocks.length


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
        layers = tuple(layers)
        if not layers:
            raise ValueError("layers must be non-empty")
        for i, g in enumerate(layers):
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
        self.layers: tuple[LayerGeometry, ...] = layers
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype = np.dtype(dtype)
        self.sliding_window, self.sink_tokens = sliding_window, sink_tokens
        self._tables = BlockTables(layers, num_blocks, block_size, self.dtype, sliding_window, sink_tokens,
                                   prefix_caching)
        self._prefixes = PrefixSharing(self._tables.blocks, block_size)
        self._seqs: dict[Hashable, _Seq] = {}

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
        self._seqs[seq_id] = _Seq(self._tables.new_table(seq_id, reserved))

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
        return self._get(seq_id).blocks.length

    def dropped_tokens(self, seq_id: Hashable) -> int:
        """Tokens evicted by the window so far, so callers can keep absolute position ids."""
        return self._get(seq_id).blocks.dropped

    def block_table(self, seq_id: Hashable) -> list[int | None]:
        """Physical block ids of the sequence, ``None`` where an evicted block was freed."""
        return list(self._get(seq_id).blocks.table)

    def owned_blocks(self, seq_id: Hashable) -> list[int]:
        """Every block the sequence holds: its table, then what is left of its reservation."""
        return self._get(seq_id).blocks.blocks()

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation can take: free ones and cached ones no sequence holds."""
        return self._tables.blocks.available

    @property
    def used_blocks(self) -> int:
        """Blocks some sequence holds (a shared block counts once)."""
        return self.num_blocks - self._tables.blocks.available

    def blocks_needed(self, seq_id: Hashable, extra_tokens: int) -> int:
        """Net new blocks an append of ``extra_tokens`` needs, for admission control.

        Blocks that the append's own window eviction would free are netted off, so
        ``append`` succeeds exactly when ``blocks_needed(...) <= free_blocks``. A sequence
        with a reservation needs 0 pool blocks, or raises ``KVCacheCapacityError`` when
        the append would outgrow its grant.
        """
        if extra_tokens < 0:
            raise ValueError(f"extra_tokens must be >= 0, got {extra_tokens}")
        return self._tables.blocks_needed(seq_id, self._get(seq_id).blocks, extra_tokens)

    # ------------------------------------------------------------------ prefix caching

    @property
    def prefix_caching(self) -> bool:
        return self._prefixes.enabled

    @property
    def cached_blocks(self) -> int:
        """Named blocks no sequence holds: kept for later prompts, counted in ``free_blocks``."""
        return self._tables.blocks.cached

    def block_names(self) -> dict[int, int]:
        """Block -> the name of the full block of KV it holds (``kv.prefix_cache``), for a
        ledger that rebuilds its view of this pool."""
        return dict(self._tables.blocks.names)

    def frozen_tokens(self, seq_id: Hashable) -> int:
        """Leading tokens of the sequence in named blocks: a rewind may not go below them."""
        return self._get(seq_id).prefix.frozen * self.block_size

    def share_prefix(self, seq_id: Hashable, tokens: Sequence[int], blocks: Sequence[int] | None = None) -> int:
        """Start the empty sequence on cached blocks holding the leading full blocks of
        ``tokens`` (what its prefill would feed); returns how many tokens they cover, whose
        KV need not be fed (``PrefixSharing.share``)."""
        s = self._get(seq_id)
        if s.blocks.end or s.blocks.table:
            raise ValueError(f"sequence {seq_id!r} already holds KV; only an empty sequence starts on a cached prefix")
        shared = self._prefixes.share(seq_id, s.prefix, tokens, blocks)
        self._tables.start_on(s.blocks, shared)
        s.kept.written = s.blocks.end
        return s.blocks.end

    def publish(self, seq_id: Hashable, tokens: Sequence[int]) -> int:
        """``tokens`` are the sequence's first tokens and their KV is final (committed: no
        later rewind goes below them). Name each full block among them, so that later
        prompts starting with the same tokens share it; from now on it is immutable (its
        KV is written to the pools now, and a rewind into it is refused). Returns how many
        leading blocks are named."""
        s = self._get(seq_id)
        full = self._prefixes.publishable(s.prefix, tokens, s.length)
        if full > s.prefix.frozen:
            s.kept.flush(s.blocks, self._tables)  # whoever shares these blocks reads them from the pools
            self._prefixes.publish(s.prefix, s.blocks.table, tokens, full)
        return s.prefix.frozen

    def reset_prefix_cache(self) -> int:
        """Forget every named block (vLLM's ``reset_prefix_cache``): cached ones become
        free, shared ones stay with their holders until they let go. Returns the cached
        blocks freed."""
        return self._tables.blocks.reset()

    # ------------------------------------------------------------------ mutation

    def apply_sliding_window(self, seq_id: Hashable) -> None:
        """Evict the oldest non-sink tokens beyond the window and free blocks left empty.

        ``append`` calls this itself; calling it again is a no-op.
        """
        s = self._get(seq_id)
        if self._tables.apply_window(s.blocks):
            s.kept.session = None  # append_from_session refuses windows: nothing pending

    def append(self, seq_id: Hashable, keys: Sequence[np.ndarray], values: Sequence[np.ndarray]) -> None:
        """Append ``n`` tokens of KV to every layer, then apply the sliding window.

        ``keys[l]`` and ``values[l]`` are ``[kv_heads_l, n, head_dim_l]`` or with a leading batch
        axis of 1. Atomic: on any error (bad shapes, not enough blocks) nothing changes.
        """
        s = self._get(seq_id)
        keys, values, n = self._tables.check_kv(keys, values)
        s.kept.flush(s.blocks, self._tables)
        old_end = self._tables.allocate(seq_id, s.blocks, n)
        s.kept.session = None
        # Write only the new tokens that survived the eviction (some may be evicted at once).
        slots = np.arange(old_end, s.blocks.end)
        alive = (slots < self.sink_tokens) | (slots >= self.sink_tokens + s.blocks.dropped)
        self._tables.write(s.blocks, slots[alive], [k[:, alive] for k in keys], [v[:, alive] for v in values])
        s.kept.written = s.length

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
        self._tables.allocate(seq_id, s.blocks, n)
        s.kept.session = SessionPast(list(keys), list(values), alive)

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
        self._tables.allocate(seq_id, s.blocks, n)
        s.kept.session = SessionPast.in_buffer(buffer, length)

    def rewind(self, seq_id: Hashable, length: int, path: Sequence[int] = ()) -> None:
        """Keep the first ``length`` retained tokens, then those at retained indices ``path``
        (increasing, each at least ``length``), in that order: a chain's rewind drops the
        rejected drafts after ``length``; a token tree's keeps its accepted path, whose
        nodes need not be contiguous. The session copy only marks dropped slots dead (an
        in-place buffer moves the path down: ``KeptPast.rewind``); in the pools a kept
        path moves to its new slots, and blocks wholly past the new end are freed.

        Rewinding into the sink tokens makes the evicted gap irrelevant, so the window's
        count resets. A rewind below the sequence's named (shared) blocks is refused: they
        are immutable. A path under a sliding window is refused: speculation is off there.
        """
        s = self._get(seq_id)
        retained = s.length
        if not 0 <= length <= retained:
            raise ValueError(f"rewind length must be in [0, {retained}] for sequence {seq_id!r}, got {length}")
        if length < s.prefix.frozen * self.block_size:
            raise KVCacheError(f"sequence {seq_id!r} cannot rewind to {length} tokens: its first "
                               f"{s.prefix.frozen * self.block_size} are in shared (named) blocks, which are immutable")
        if path:
            path = [int(i) for i in path]
            if any(b <= a for a, b in zip(path, path[1:])) or path[0] < length or path[-1] >= retained:
                raise ValueError(f"a rewind's path must be increasing retained indices in [{length}, {retained}), "
                                 f"got {path}")
            if s.blocks.dropped:
                raise ValueError("a rewind that keeps a path needs a sequence with nothing evicted")
            if path == list(range(length, length + len(path))):
                length, path = length + len(path), []  # a prefix after all: a chain's rewind
        if path and s.kept.session is None:  # the KV is in the pools only: move the path there
            self._tables.move(s.blocks, np.asarray(path, np.intp), length)
            s.kept.written = length + len(path)  # without a copy, every retained token is in the pools
        else:
            s.kept.rewind(length, retained, path)
        self._tables.truncate(s.blocks, length + len(path))

    def free(self, seq_id: Hashable) -> None:
        """Release all blocks of the sequence and forget it. Its named blocks stay cached
        (held by any other sequence that shares them, else reusable by later prompts)."""
        self._tables.release_all(self._get(seq_id).blocks)
        del self._seqs[seq_id]

    # ------------------------------------------------------------------ reading

    def materialize(self, seq_id: Hashable) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per layer dense ``(key, value)``, each ``[1, kv_heads_l, length, head_dim_l]`` (copies)."""
        s = self._get(seq_id)
        s.kept.flush(s.blocks, self._tables)
        return self._tables.gather(s.blocks)

    def session_past(self, seq_id: Hashable, compact: bool = True) -> SessionPast:
        """The sequence's past in the session's layout, possibly with dead slots: the copy
        kept from the last call, or a fresh gather from the pools (``kv/session_past.py``).
        ``compact=False`` keeps a copy however many slots are dead (a caller that copies the
        live slots out anyway). Callers must not write into the returned tensors."""
        s = self._get(seq_id)
        kept = s.kept.session
        if compact and kept is not None and kept.wasteful:
            kept = None
        if kept is None:
            kept = s.kept.session = self.gathered_past(seq_id)  # writes pending tokens out of the old copy first
        return kept

    def read_into(self, seq_id: Hashable, keys: Sequence[np.ndarray], values: Sequence[np.ndarray]) -> None:
        """Copy the retained past into slots ``[0, length)`` of per-layer ``[1, heads, C,
        dim]`` arrays (an in-place buffer), straight from the pools: one copy, where
        ``gathered_past`` and copying its result would make several (a sequence that
        starts on a long cached prefix reads it so). Not under a window (no holes)."""
        s = self._get(seq_id)
        if s.blocks.dropped:
            raise ValueError("read_into needs a sequence with nothing evicted")
        s.kept.flush(s.blocks, self._tables)
        self._tables.read_into(s.blocks, keys, values)

    def copy_past_into(self, seq_id: Hashable, keys: Sequence[np.ndarray], values: Sequence[np.ndarray]) -> None:
        """Copy the retained past into slots ``[0, length)`` of per-layer ``[1, heads, C,
        dim]`` arrays (a new in-place buffer): from the session copy's live slots where
        the cache keeps one, else from the pools (``read_into``)."""
        s = self._get(seq_id)
        if s.kept.session is None:
            self.read_into(seq_id, keys, values)
        else:
            s.kept.copy_into(keys, values, s.length)

    def kept_session(self, seq_id: Hashable) -> SessionPast | None:
        """The session-layout copy the cache holds for the sequence now (no gather), or
        None; callers compare it by identity to know whether a copy is still current."""
        return self._get(seq_id).kept.session

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
        padded batch anyway: a copy here would be paid every round for nothing. From
        another session copy, which holds every retained token (pending ones too),
        copying one layer's live slots out beats writing all layers' pending tokens to
        the pools and gathering blocks back (a shared-KV head reads this every round)."""
        s = self._get(seq_id)
        if not 0 <= layer < len(self.layers):
            raise IndexError(f"layer {layer} out of range: the cache has {len(self.layers)} layers")
        if s.kept.session is not None:
            return s.kept.layer(layer)
        return self._tables.gather_layer(s.blocks, layer)
