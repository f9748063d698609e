"""A sequence's KV in the form its model calls read and write: the session's own layout.

Gathering every sequence's whole past out of the pools on every model call costs as much
as a small model's step. So each sequence keeps the dense per-layer tensors the session
itself returned last time (its ``present`` outputs), with a bool ``alive`` per slot
(``SessionPast``). The next call feeds them back as the past unchanged, and a rewind only
marks the rejected slots dead (the attention mask closes them), so neither a step nor a
rewind copies the past. That copy may be a row of the last batched call's presents
(``kv/batch_layout.py``) or the live prefix of an in-place buffer (``engine.model.in_place``):
one object either way, and the only one the calls read.

The new tokens reach the pools (``kv/block_tables.py``) lazily, when something reads the
pools or the copy is dropped (``KeptPast.flush``): one with too many dead slots is written
out and re-gathered from the pools on next use.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from specserve.engine.kv.block_tables import BlockTable, BlockTables

# Re-gather from the pools once dead slots are this many and this share of the copy:
# each dead slot costs attention compute on every later call.
MAX_DEAD_SLOTS, MAX_DEAD_SHARE = 32, 0.25


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
        # slots. Its live slots are always a prefix (written all alive; a rewind kills a
        # tail, moving a kept tree path down first: ``KeptPast.rewind``).
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

    @property
    def wasteful(self) -> bool:
        """Dead slots cost more on every call than one re-gather does (``MAX_DEAD_*``)."""
        dead = self.dead
        return dead >= MAX_DEAD_SLOTS and dead >= MAX_DEAD_SHARE * self.slots

    def live(self) -> slice | np.ndarray:
        """Index of the live slots along the slot axis, in order (a plain slice when no
        slot is dead, so taking them is a view, not a gather)."""
        return slice(None) if self._alive is None or self._alive.all() else np.flatnonzero(self._alive)


class KeptPast:
    """One sequence's session copy (``session``, None when it has none) and how many of
    its retained tokens the pools hold too (``written``); the rest live only in the copy."""

    __slots__ = ("session", "written")

    def __init__(self) -> None:
        self.session: SessionPast | None = None
        self.written = 0

    def flush(self, t: BlockTable, tables: BlockTables) -> None:
        """Write tokens that so far live only in the session copy into the pools (no
        window when any are pending, so a retained index is its physical slot)."""
        if self.written >= t.length:
            return
        assert self.session is not None, "pending KV without the session copy that holds it"
        live = np.flatnonzero(self.session.alive)[self.written : t.length]
        tables.write(t, np.arange(self.written, t.length), [k[0][:, live] for k in self.session.keys],
                     [v[0][:, live] for v in self.session.values])
        self.written = t.length

    def rewind(self, length: int, retained: int, path: Sequence[int]) -> None:
        """The copy's part of a rewind from ``retained`` tokens to the first ``length`` and
        then those at retained indices ``path`` (``PagedKVCache.rewind``): their slots stay
        alive, the others die. An in-place buffer keeps its live slots a prefix, so there
        the path's KV moves down to follow the first ``length`` first. Tokens past
        ``length`` are no longer the pools' (``written``): a kept path is written out
        again from here at its new place."""
        self.written = min(self.written, length)
        past = self.session
        if past is None or length + len(path) >= retained:
            return
        if past.buffer is not None and path:
            kept = length + len(path)
            for array in (*past.buffer.keys, *past.buffer.values):  # type: ignore[attr-defined]
                array[:, :, length:kept] = array[:, :, np.asarray(path, np.intp)]
            past.alive[kept:retained] = False  # live slots are a prefix: slot = retained index
            return
        alive_slots = np.flatnonzero(past.alive)
        if not path:  # a chain's rewind: the tail dies (every round's case, kept cheap)
            past.alive[alive_slots[length:]] = False
            return
        dying = np.ones(retained - length, np.bool_)
        dying[np.asarray(path, np.intp) - length] = False
        past.alive[alive_slots[length:retained][dying]] = False

    def layer(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """One layer's live ``(key, value)`` from the copy (``PagedKVCache.slice``)."""
        past = self.session
        assert past is not None
        if past.buffer is not None:
            live = past.slots - past.dead  # a buffer's live slots are a prefix
            buffer = past.buffer
            views = buffer.keys[layer][:, :, :live], buffer.values[layer][:, :, :live]  # type: ignore[attr-defined]
            for view in views:
                view.flags.writeable = False  # a reader writing into it would write the KV
            return views
        live = past.live()
        return np.ascontiguousarray(past.keys[layer][:, :, live]), np.ascontiguousarray(past.values[layer][:, :, live])

    def copy_into(self, keys: Sequence[np.ndarray], values: Sequence[np.ndarray], length: int) -> None:
        """Copy the copy's live slots into slots ``[0, length)`` of per-layer arrays."""
        past = self.session
        assert past is not None
        live = past.live()
        for layer, (key, value) in enumerate(zip(past.keys, past.values)):
            keys[layer][:, :, :length] = key[:, :, live]
            values[layer][:, :, :length] = value[:, :, live]
