"""Batched calls in place: one buffer per layer for a batch, one row per sequence.

A row-invariant family's in-place graph (``engine.model.graph_family``) serves batches:
per layer ``[R, heads, capacity, dim]`` bound as past and present, each row holding one
sequence's live past at slots ``[0, length)``, and the call writing each sequence's new
tokens right after its own length. A row's real keys therefore always sit at the same
slots as in the sequence's batch-1 buffer, which is what keeps its computation identical
to a batch-1 call (``modelbuild.invariant_graph``); and nothing is concatenated or copied
per call: a rewind is a shorter length.

Each row is also the sequence's own in-place buffer (a ``KVBuffer`` over views of the
row), so its session copy in the cache is that row, a batch-1 call runs on it in place,
and the next batched call of the same sequences reuses the whole buffer untouched. A
call that holds other sequences copies each newcomer's live past into a free row, or
builds a new buffer when that wastes less: the rules of ``kv.batch_layout`` (a row
whose sequence is not in the call runs as a masked dummy; more dummies than a quarter
of the call, or a capacity too small, rebuild). A dummy row's writes land after its own
length, where nothing is live.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np
import onnxruntime as ort

from specserve.engine.kv.paged_cache import PagedKVCache
from specserve.engine.model.in_place import InPlaceDecoder, KVBuffer, buffer_capacity

KEPT_BUFFERS = 4  # one per lane (the server runs 2 by default) and then some


@dataclass(eq=False)
class RowsBuffer:
    """Per layer ``[R, heads, capacity, dim]`` keys and values, which sequence each row
    holds (and the ``KVBuffer`` over it its session copy points at), and the binding."""

    keys: list[np.ndarray]
    values: list[np.ndarray]
    rows: list[tuple[Hashable, KVBuffer] | None]
    binding: ort.IOBinding
    _ort_values: list[ort.OrtValue] = field(default_factory=list)  # must outlive the binding

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def current_rows(self, cache: PagedKVCache) -> dict[Hashable, int]:
        """Sequence -> row, for rows still holding their sequence's current session copy."""
        current = {}
        for row, entry in enumerate(self.rows):
            if entry is not None and cache.has_sequence(entry[0]):
                session = cache.kept_session(entry[0])
                if session is not None and session.buffer is entry[1]:
                    current[entry[0]] = row
        return current


@dataclass(eq=False)
class RowsCall:
    """Where each sequence of one batched call sits, and every row's length."""

    buffer: RowsBuffer
    row_of: list[int]        # per requested sequence, in request order
    lengths: np.ndarray      # per row: the live slots the call writes after (0 for a free row)


class RowBuffers:
    """The last few batched calls' buffers of one decoder (module docstring)."""

    def __init__(self, cache: PagedKVCache, decoder: InPlaceDecoder, max_context: int,
                 keep: int = KEPT_BUFFERS) -> None:
        self.cache, self.decoder, self.max_context, self.keep = cache, decoder, max_context, keep
        self._buffers: list[RowsBuffer] = []
        # For benchmarks and tests: calls on a kept buffer, fresh builds, sequences copied
        # into a free row, dummy rows run.
        self.reused = self.rebuilt = self.placed = self.dummy_rows = 0

    def arrange(self, seq_ids: Sequence[Hashable], width: int) -> RowsCall:
        """The buffer for a call of ``seq_ids`` (distinct, all in the cache) with up to
        ``width`` new tokens each."""
        best, best_rows = None, {}
        for buffer in list(self._buffers):
            current = buffer.current_rows(self.cache)
            if not current:  # nothing reads it any more: let its memory go
                self._buffers.remove(buffer)
            elif len(current.keys() & set(seq_ids)) > len(best_rows.keys() & set(seq_ids)):
                best, best_rows = buffer, current
        call = self._reuse(best, best_rows, seq_ids, width) if best is not None else None
        if call is None:
            self.rebuilt += 1
            return self._build(seq_ids, width)
        self.reused += 1
        return call

    def _reuse(self, buffer: RowsBuffer, current: dict[Hashable, int], seq_ids: Sequence[Hashable],
               width: int) -> RowsCall | None:
        """Fit ``seq_ids`` into ``buffer``, or None when a fresh build wastes less."""
        wanted, taken = set(seq_ids), set(current.values())
        free = [row for row in range(len(buffer.rows)) if row not in taken]
        newcomers = [seq for seq in seq_ids if seq not in current]
        dummies = len(buffer.rows) - len(seq_ids)
        if len(newcomers) > len(free) or dummies > len(seq_ids) // 4:
            return None
        lengths = np.zeros(len(buffer.rows), np.int64)
        for seq, row in current.items():
            lengths[row] = self.cache.length(seq)
        for seq in newcomers:
            if self.cache.length(seq) + width > buffer.capacity:
                return None
        if int(lengths.max(initial=0)) + width > buffer.capacity:
            return None
        placed = dict(zip(newcomers, free))
        for seq, row in placed.items():
            self._place(buffer, seq, row)
            lengths[row] = self.cache.length(seq)
        self.placed += len(placed)
        self.dummy_rows += dummies
        row_of = [current[seq] if seq in current and seq in wanted else placed[seq] for seq in seq_ids]
        return RowsCall(buffer, row_of, lengths)

    def _build(self, seq_ids: Sequence[Hashable], width: int) -> RowsCall:
        """A buffer of exactly these sequences, each copied into its row."""
        lengths = np.array([self.cache.length(seq) for seq in seq_ids], np.int64)
        capacity = buffer_capacity(int(lengths.max()) + width, self.max_context)
        keys, values = [], []
        for geometry in self.decoder.standard.layers:
            # Zeros: a slot past a row's length is never read, but garbage there could be NaN.
            shape = (len(seq_ids), geometry.num_kv_heads, capacity, geometry.head_dim)
            keys.append(np.zeros(shape, self.decoder.standard.kv_dtype))
            values.append(np.zeros(shape, self.decoder.standard.kv_dtype))
        binding, kept = self.decoder.bind_rows(keys, values)
        buffer = RowsBuffer(keys, values, [None] * len(seq_ids), binding, kept)
        for row, seq in enumerate(seq_ids):
            self._place(buffer, seq, row)
        self._buffers.insert(0, buffer)
        del self._buffers[self.keep:]
        return RowsCall(buffer, list(range(len(seq_ids))), lengths)

    def _place(self, buffer: RowsBuffer, seq: Hashable, row: int) -> None:
        """Copy ``seq``'s live past into ``row``; the row's views become its buffer."""
        row_buffer = self.decoder.view_buffer([k[row : row + 1] for k in buffer.keys],
                                              [v[row : row + 1] for v in buffer.values])
        self.cache.copy_past_into(seq, row_buffer.keys, row_buffer.values)
        buffer.rows[row] = (seq, row_buffer)

    def run(self, call: RowsCall, tokens: Sequence[Sequence[int]]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Run each sequence's ``tokens`` (request order) in its row; the other rows' new
        tokens are padding written after their lengths. Returns logits ``[R, S, V]`` and
        extras, by row."""
        width = max(len(t) for t in tokens)
        ids = np.zeros((len(call.buffer.rows), width), np.int64)
        for row, new in zip(call.row_of, tokens):
            ids[row, : len(new)] = new
        return self.decoder.run_rows(call.buffer.binding, call.lengths, ids)

    def row_buffer(self, call: RowsCall, index: int) -> KVBuffer:
        """The ``KVBuffer`` of the ``index``-th requested sequence's row."""
        entry = call.buffer.rows[call.row_of[index]]
        assert entry is not None
        return entry[1]

    def forget(self, call: RowsCall) -> None:
        """The call failed part-way: trust nothing about the buffer it used."""
        if call.buffer in self._buffers:
            self._buffers.remove(call.buffer)
