"""Batched pasts kept in the layout of the last batched call.

At batch > 1 a session takes one padded past per layer, ``[B, heads, L, dim]``. Building
it from every sequence's own past on every call copies each whole past twice (zeros,
then the rows), and with rewinds' dead slots forcing per-sequence re-gathers that is a
large share of a batched call's time (docs/design-decisions.md). Yet the last batched
call's ``present`` outputs already are such a tensor,
holding those sequences' pasts plus what that call appended, and each sequence's
session copy (``PagedKVCache.session_past``) is a row of it. So the decoder keeps them
as a ``BatchLayout``:

- the next call with the same sequences feeds them back untouched (no copy at all);
- a sequence that left frees its row; one that joined is copied into a free row (one
  past, not all of them);
- a row whose sequence is alive but not in this call runs as a masked dummy row (its
  own copy is not touched: it keeps pointing at the older tensor);
- the layout is rebuilt, every row compacted to its live slots, when it would waste
  more than the copy costs: dummy rows beyond a quarter of the call's sequences, or a
  past longer than the longest live one by ``MAX_DEAD_SLOTS`` and ``MAX_DEAD_SHARE``.

A row is only ever written while nothing reads it: a row is free exactly when the cache
no longer holds the session object recorded for it (the sequence was freed, re-gathered
or moved to another call's tensor). A few layouts are kept, so that the server's lanes
(separate batches on one target) do not rebuild each other's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np

from specserve.engine.kv.paged_cache import PagedKVCache
from specserve.engine.kv.session_past import MAX_DEAD_SHARE, MAX_DEAD_SLOTS, SessionPast

KEPT_LAYOUTS = 4  # one per lane (the server runs 2 by default) and then some


@dataclass(eq=False)  # compared by identity: it holds arrays
class BatchLayout:
    """One batched call's presents and which sequence's session copy each row is."""

    keys: list[np.ndarray]      # per layer [B, heads, L, dim]
    values: list[np.ndarray]
    rows: list[tuple[Hashable, SessionPast] | None]

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]

    def current_rows(self, cache: PagedKVCache) -> dict[Hashable, int]:
        """Sequence -> row, for rows still holding their sequence's current session copy."""
        current = {}
        for row, entry in enumerate(self.rows):
            if entry is not None and cache.has_sequence(entry[0]) and cache.kept_session(entry[0]) is entry[1]:
                current[entry[0]] = row
        return current


@dataclass(eq=False)
class Arrangement:
    """Where each sequence of one batched call sits, and the past to feed."""

    keys: list[np.ndarray]
    values: list[np.ndarray]
    row_of: list[int]                 # per requested sequence, in request order
    alive: list[np.ndarray | None]    # per row: its live past slots; None for a dummy row
    layout: BatchLayout | None        # the kept layout it reuses (None: freshly built)

    @property
    def batch(self) -> int:
        return len(self.alive)

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]


class BatchLayouts:
    """The last few batched calls' layouts of one decoder's cache (see module docstring)."""

    def __init__(self, cache: PagedKVCache, keep: int = KEPT_LAYOUTS) -> None:
        self.cache, self.keep = cache, keep
        self._layouts: list[BatchLayout] = []
        # What happened so far, for benchmarks and tests: calls on a kept layout, fresh
        # builds, sequences copied into a free row, dummy rows run.
        self.reused = self.rebuilt = self.placed = self.dummy_rows = 0

    def arrange(self, seq_ids: Sequence[Hashable]) -> Arrangement:
        """The past for a batched call of ``seq_ids`` (distinct, all in the cache)."""
        best, best_rows = None, {}
        for layout in list(self._layouts):
            current = layout.current_rows(self.cache)
            if not current:  # nothing reads it any more: let its memory go
                self._layouts.remove(layout)
            elif len(current.keys() & set(seq_ids)) > len(best_rows.keys() & set(seq_ids)):
                best, best_rows = layout, current
        arrangement = self._reuse(best, best_rows, seq_ids) if best is not None else None
        if arrangement is None:
            self.rebuilt += 1
            return self._build(seq_ids)
        self.reused += 1
        return arrangement

    def _reuse(self, layout: BatchLayout, current: dict[Hashable, int],
               seq_ids: Sequence[Hashable]) -> Arrangement | None:
        """Fit ``seq_ids`` into ``layout``, or None when a fresh build wastes less."""
        wanted = set(seq_ids)
        taken = {row for seq, row in current.items() if seq in wanted}
        held = set(current.values())
        free = [row for row in range(len(layout.rows)) if row not in held]
        newcomers = [seq for seq in seq_ids if seq not in current]
        if len(newcomers) > len(free):
            return None
        dummies = len(layout.rows) - len(seq_ids)
        if dummies > len(seq_ids) // 4:
            return None
        pasts = {seq: self.cache.session_past(seq, compact=False) for seq in newcomers}
        live = {seq: int(np.count_nonzero(p.alive)) for seq, p in pasts.items()}
        live.update({seq: int(np.count_nonzero(layout.rows[row][1].alive))
                     for seq, row in current.items() if seq in wanted})
        length = layout.length
        slack = length - max(live.values())
        if slack < 0 or (slack >= MAX_DEAD_SLOTS and slack >= MAX_DEAD_SHARE * length):
            return None
        alive: list[np.ndarray | None] = [None] * len(layout.rows)
        for row in taken:
            alive[row] = layout.rows[row][1].alive
        placed = dict(zip(newcomers, free))
        for seq, row in placed.items():
            _copy_live(pasts[seq], layout.keys, layout.values, row)
            alive[row] = np.arange(length) < live[seq]
        row_of = [current[seq] if seq in current else placed[seq] for seq in seq_ids]
        self.placed += len(placed)
        self.dummy_rows += dummies
        return Arrangement(layout.keys, layout.values, row_of, alive, layout)

    def _build(self, seq_ids: Sequence[Hashable]) -> Arrangement:
        """Every sequence's live slots, compacted and padded to the longest."""
        pasts = [self.cache.session_past(seq, compact=False) for seq in seq_ids]
        live = [int(np.count_nonzero(p.alive)) for p in pasts]
        length = max(live)
        keys, values = [], []
        for layer in range(len(pasts[0].keys)):
            _, heads, _, dim = pasts[0].keys[layer].shape
            dtype = pasts[0].keys[layer].dtype
            # Zeros, not empty: a padded slot is masked, but garbage there could be NaN,
            # and 0 x NaN in the attention's weighted sum would still poison the row. Nor
            # empty plus zeroing only the padding: the copies then pay the fresh pages'
            # faults, which makes rebuilds slower than zeroing everything first.
            keys.append(np.zeros((len(seq_ids), heads, length, dim), dtype))
            values.append(np.zeros((len(seq_ids), heads, length, dim), dtype))
        for row, past in enumerate(pasts):
            _copy_live(past, keys, values, row)
        alive = [np.arange(length) < n for n in live]
        return Arrangement(keys, values, list(range(len(seq_ids))), alive, None)

    def remember(self, arrangement: Arrangement, seq_ids: Sequence[Hashable],
                 presents: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        """The call ran and every sequence's session copy is now its row of ``presents``."""
        if arrangement.layout is not None and arrangement.layout in self._layouts:
            self._layouts.remove(arrangement.layout)
        rows: list[tuple[Hashable, SessionPast] | None] = [None] * arrangement.batch
        for seq, row in zip(seq_ids, arrangement.row_of):
            rows[row] = (seq, self.cache.kept_session(seq))
        self._layouts.insert(0, BatchLayout([k for k, _ in presents], [v for _, v in presents], rows))
        del self._layouts[self.keep:]

    def forget(self, arrangement: Arrangement) -> None:
        """The call failed part-way: trust nothing about the layout it used."""
        if arrangement.layout is not None and arrangement.layout in self._layouts:
            self._layouts.remove(arrangement.layout)


def _copy_live(past: SessionPast, keys: list[np.ndarray], values: list[np.ndarray], row: int) -> None:
    """Write ``past``'s live slots, in order, to the start of ``row`` of every layer."""
    live = past.live()
    n = int(np.count_nonzero(past.alive))
    for layer, (key, value) in enumerate(zip(past.keys, past.values)):
        keys[layer][row, :, :n] = key[0][:, live]
        values[layer][row, :, :n] = value[0][:, live]
