"""Tests of the paged KV cache against a plain dense reference model."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from specserve.engine.kv.admission import Admission
from specserve.engine.kv.block_ledger import AdmissionError, BlockLedger
from specserve.engine.kv.paged_cache import (
    KVCacheCapacityError,
    KVCacheError,
    LayerGeometry,
    PagedKVCache,
    UnknownSequenceError,
)

GEOMETRY = (LayerGeometry(num_kv_heads=2, head_dim=8), LayerGeometry(num_kv_heads=3, head_dim=16))
BLOCK = 4


def _kv(n: int, seed: int, layers=GEOMETRY, batch_axis: bool = False):
    """Distinct random keys/values for ``n`` tokens, one pair per layer."""
    rng = np.random.default_rng(seed)
    keys = [rng.standard_normal((g.num_kv_heads, n, g.head_dim)).astype(np.float32) for g in layers]
    values = [rng.standard_normal((g.num_kv_heads, n, g.head_dim)).astype(np.float32) for g in layers]
    if batch_axis:
        keys, values = [k[None] for k in keys], [v[None] for v in values]
    return keys, values


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class DenseReference:
    """The obvious model: dense per-layer arrays per sequence, concatenated and sliced."""

    def __init__(self, layers, sliding_window=None, sink_tokens=0):
        self.layers, self.window, self.sinks = layers, sliding_window, sink_tokens
        self.kv: dict = {}
        self.dropped: dict = {}

    def add(self, sid):
        self.kv[sid] = [(np.zeros((g.num_kv_heads, 0, g.head_dim), np.float32),) * 2 for g in self.layers]
        self.dropped[sid] = 0

    def append(self, sid, keys, values):
        layers = [(np.concatenate([k, nk], axis=1), np.concatenate([v, nv], axis=1))
                  for (k, v), nk, nv in zip(self.kv[sid], keys, values)]
        length = layers[0][0].shape[1]
        if self.window is not None and length > self.window:
            excess = length - self.window
            s = self.sinks
            layers = [(np.concatenate([k[:, :s], k[:, s + excess:]], axis=1),
                       np.concatenate([v[:, :s], v[:, s + excess:]], axis=1)) for k, v in layers]
            self.dropped[sid] += excess
        self.kv[sid] = layers

    def rewind(self, sid, length):
        self.kv[sid] = [(k[:, :length], v[:, :length]) for k, v in self.kv[sid]]
        if length < self.sinks:
            self.dropped[sid] = 0

    def keep_path(self, sid, length, path):
        """A token tree's rewind: the first ``length`` tokens, then those at ``path``."""
        self.kv[sid] = [(np.concatenate([k[:, :length], k[:, path]], axis=1),
                         np.concatenate([v[:, :length], v[:, path]], axis=1)) for k, v in self.kv[sid]]

    def free(self, sid):
        del self.kv[sid], self.dropped[sid]

    def length(self, sid):
        return self.kv[sid][0][0].shape[1]

    def expected_table_shape(self, sid, block_size):
        """(table length, indices of holes) that exact accounting implies."""
        dropped = self.dropped[sid]
        end = self.length(sid) + dropped
        holes = set(range(_ceil_div(self.sinks, block_size), (self.sinks + dropped) // block_size))
        return _ceil_div(end, block_size), holes


def _draw_path(data, length: int, retained: int) -> list[int]:
    """An increasing path of retained indices after ``length`` (maybe none)."""
    if retained == length:
        return []
    return sorted(data.draw(st.sets(st.integers(length, retained - 1), max_size=5)))


class CacheMachine(RuleBasedStateMachine):
    """Random add/append/rewind/free on the paged cache and the reference, compared each step."""

    WINDOW: int | None = None
    SINKS = 0
    NUM_BLOCKS = 6
    SEQ_IDS = st.sampled_from(["a", "b", "c"])

    def __init__(self):
        super().__init__()
        self.cache = PagedKVCache(GEOMETRY, num_blocks=self.NUM_BLOCKS, block_size=BLOCK,
                                  sliding_window=self.WINDOW, sink_tokens=self.SINKS)
        self.ref = DenseReference(GEOMETRY, self.WINDOW, self.SINKS)
        self.capacity_errors = 0

    @initialize()
    def start_with_two_sequences(self):
        for sid in ("a", "b"):
            self.cache.add_sequence(sid)
            self.ref.add(sid)

    @rule(sid=SEQ_IDS)
    def add(self, sid):
        if sid in self.ref.kv:
            with pytest.raises(ValueError):
                self.cache.add_sequence(sid)
        else:
            self.cache.add_sequence(sid)
            self.ref.add(sid)

    APPEND_ARGS = dict(sid=SEQ_IDS, n=st.integers(1, 9), seed=st.integers(0, 2**32 - 1), batch_axis=st.booleans())

    @rule(**APPEND_ARGS)
    def append(self, sid, n, seed, batch_axis):
        self._append(sid, n, seed, batch_axis)

    @rule(**APPEND_ARGS)
    def append_again(self, sid, n, seed, batch_axis):
        """A second append rule so growth (and hence eviction and capacity errors) is common."""
        self._append(sid, n, seed, batch_axis)

    def _append(self, sid, n, seed, batch_axis):
        keys, values = _kv(n, seed, batch_axis=batch_axis)
        if sid not in self.ref.kv:
            with pytest.raises(UnknownSequenceError):
                self.cache.append(sid, keys, values)
            return
        needed, free = self.cache.blocks_needed(sid, n), self.cache.free_blocks
        if needed > free:
            with pytest.raises(KVCacheCapacityError):
                self.cache.append(sid, keys, values)
            self.capacity_errors += 1  # reference untouched: the invariants prove nothing changed
            assert self.cache.free_blocks == free
        else:
            self.cache.append(sid, keys, values)
            self.ref.append(sid, [k.reshape(k.shape[-3:]) for k in keys],
                            [v.reshape(v.shape[-3:]) for v in values])

    @precondition(lambda self: self.WINDOW is None and self.ref.kv)
    @rule(data=st.data(), seed=st.integers(0, 2**32 - 1))
    def session_steps(self, data, seed):
        """What the decoder does: feed the session's own past, hand back its whole output
        (old slots + batch padding + new tokens), rewind some; between steps the pools are
        never read, so pending tokens and dead slots pile up across rewinds."""
        sid = data.draw(st.sampled_from(sorted(self.ref.kv)))
        rng = np.random.default_rng(seed)
        for _ in range(data.draw(st.integers(1, 4))):
            n, pad = data.draw(st.integers(1, 5)), data.draw(st.integers(0, 3))
            if self.cache.blocks_needed(sid, n) > self.cache.free_blocks:
                with pytest.raises(KVCacheCapacityError):
                    self.cache.append_from_session(sid, *self._session_output(sid, n, pad, rng))
                return
            keys, values, alive = self._session_output(sid, n, pad, rng)
            self.cache.append_from_session(sid, keys, values, alive)
            self.ref.append(sid, [k[0][:, -n:] for k in keys], [v[0][:, -n:] for v in values])
            length = data.draw(st.integers(0, self.ref.length(sid)))
            path = _draw_path(data, length, self.ref.length(sid))  # a tree's path, or a chain's (none)
            self.cache.rewind(sid, length, path)
            self.ref.keep_path(sid, length, path)
            past = self.cache.session_past(sid)
            for (k, v), (rk, rv) in zip(zip(past.keys, past.values), self.ref.kv[sid]):
                assert np.array_equal(k[0][:, past.alive], rk) and np.array_equal(v[0][:, past.alive], rv)

    def _session_output(self, sid, n, pad, rng):
        """The past the session was fed, ``pad`` padding slots, then ``n`` new tokens."""
        past = self.cache.session_past(sid)
        keys, values = [], []
        for g, k, v in zip(GEOMETRY, past.keys, past.values):
            extra = rng.standard_normal((2, 1, g.num_kv_heads, pad + n, g.head_dim)).astype(np.float32)
            keys.append(np.concatenate([k, extra[0]], axis=2))
            values.append(np.concatenate([v, extra[1]], axis=2))
        alive = np.concatenate([past.alive, np.zeros(pad, np.bool_), np.ones(n, np.bool_)])
        return keys, values, alive

    @precondition(lambda self: self.ref.kv)
    @rule(data=st.data())
    def rewind(self, data):
        sid = data.draw(st.sampled_from(sorted(self.ref.kv)))
        length = data.draw(st.integers(0, self.ref.length(sid)))
        free_before, table_before = self.cache.free_blocks, self.cache.block_table(sid)
        self.cache.rewind(sid, length)
        self.ref.rewind(sid, length)
        expected_len, _ = self.ref.expected_table_shape(sid, BLOCK)
        table = self.cache.block_table(sid)
        assert len(table) == expected_len <= len(table_before)
        dropped = [b for b in table_before if b is not None and b not in table]
        assert self.cache.free_blocks == free_before + len(dropped)  # exactly the blocks it gave up

    @precondition(lambda self: self.WINDOW is None and self.ref.kv)
    @rule(data=st.data())
    def rewind_to_a_path(self, data):
        """A token tree's rewind: the first tokens, then an increasing path of later ones,
        whose KV moves to follow them (in the pools here: no session copy after ``append``)."""
        sid = data.draw(st.sampled_from(sorted(self.ref.kv)))
        retained = self.ref.length(sid)
        length = data.draw(st.integers(0, retained))
        path = _draw_path(data, length, retained)
        free_before, table_before = self.cache.free_blocks, self.cache.block_table(sid)
        self.cache.rewind(sid, length, path)
        self.ref.keep_path(sid, length, path)
        table = self.cache.block_table(sid)
        assert table == table_before[:_ceil_div(length + len(path), BLOCK)]
        assert self.cache.free_blocks == free_before + len(table_before) - len(table)

    @precondition(lambda self: self.ref.kv)
    @rule(data=st.data())
    def rewind_too_far(self, data):
        sid = data.draw(st.sampled_from(sorted(self.ref.kv)))
        with pytest.raises(ValueError):
            self.cache.rewind(sid, self.ref.length(sid) + data.draw(st.integers(1, 5)))

    @rule(sid=SEQ_IDS)
    def free(self, sid):
        if sid not in self.ref.kv:
            with pytest.raises(UnknownSequenceError):
                self.cache.free(sid)
            return
        owned = sum(b is not None for b in self.cache.block_table(sid))
        free_before = self.cache.free_blocks
        self.cache.free(sid)
        self.ref.free(sid)
        assert self.cache.free_blocks == free_before + owned
        assert not self.cache.has_sequence(sid)

    @invariant()
    def matches_reference(self):
        assert sorted(self.cache.sequences()) == sorted(self.ref.kv)
        for sid, ref_layers in self.ref.kv.items():
            assert self.cache.length(sid) == self.ref.length(sid)
            assert self.cache.dropped_tokens(sid) == self.ref.dropped[sid]
            dense = self.cache.materialize(sid)
            assert len(dense) == len(GEOMETRY)
            for layer, ((k, v), (rk, rv)) in enumerate(zip(dense, ref_layers)):
                assert k.flags.c_contiguous and v.flags.c_contiguous and k.dtype == np.float32
                assert np.array_equal(k, rk[None]) and np.array_equal(v, rv[None])
                sk, sv = self.cache.slice(sid, layer)
                assert np.array_equal(sk, rk[None]) and np.array_equal(sv, rv[None])

    @invariant()
    def exact_block_accounting(self):
        cache = self.cache
        assert cache.free_blocks + cache.used_blocks == cache.num_blocks
        owned: list[int] = []
        for sid in self.ref.kv:
            table = cache.block_table(sid)
            expected_len, holes = self.ref.expected_table_shape(sid, BLOCK)
            assert len(table) == expected_len
            assert {i for i, b in enumerate(table) if b is None} == holes
            owned += [b for b in table if b is not None]
        assert len(owned) == len(set(owned)) == cache.used_blocks  # no block shared or leaked


class WindowedCacheMachine(CacheMachine):
    WINDOW, SINKS, NUM_BLOCKS = 7, 2, 5


class WideSinkCacheMachine(CacheMachine):
    WINDOW, SINKS, NUM_BLOCKS = 9, 5, 5  # sinks span more than one block


_SETTINGS = settings(max_examples=120, stateful_step_count=30, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestPagedCache = CacheMachine.TestCase
TestPagedCache.settings = _SETTINGS
TestWindowedCache = WindowedCacheMachine.TestCase
TestWindowedCache.settings = _SETTINGS
TestWideSinkCache = WideSinkCacheMachine.TestCase
TestWideSinkCache.settings = _SETTINGS


# ---------------------------------------------------------------------- unit tests


def _cache(**kw) -> PagedKVCache:
    kw.setdefault("num_blocks", 8)
    kw.setdefault("block_size", BLOCK)
    return PagedKVCache(GEOMETRY, **kw)


def test_session_past_is_the_sessions_own_output_and_rewinds_only_close_slots():
    cache = _cache()
    cache.add_sequence("a")
    keys, values = _kv(6, seed=1, batch_axis=True)
    cache.append_from_session("a", keys, values, np.ones(6, np.bool_))
    past = cache.session_past("a")
    assert past.keys[0] is keys[0]  # fed back as is: no gather, no copy
    cache.rewind("a", 4)
    past = cache.session_past("a")
    assert past.keys[0] is keys[0] and past.alive.tolist() == [True] * 4 + [False] * 2
    np.testing.assert_array_equal(cache.materialize("a")[1][0], keys[1][:, :, :4])  # pending data written out


def test_a_session_copy_with_too_many_dead_slots_is_regathered_compact():
    cache = _cache(num_blocks=32)
    cache.add_sequence("a")
    keys, values = _kv(80, seed=2, batch_axis=True)
    alive = np.ones(80, np.bool_)
    alive[10:50] = False  # 40 dead slots of 80: over both limits
    cache.append_from_session("a", keys, values, alive)
    past = cache.session_past("a")
    assert past.alive.all() and past.keys[0].shape[2] == 40
    np.testing.assert_array_equal(past.keys[0][0], np.concatenate([keys[0][0][:, :10], keys[0][0][:, 50:]], axis=1))


def test_session_appends_are_refused_under_a_window_and_when_nothing_is_new():
    windowed = _cache(sliding_window=6, sink_tokens=2)
    windowed.add_sequence("a")
    keys, values = _kv(3, seed=3, batch_axis=True)
    with pytest.raises(ValueError, match="sliding window"):
        windowed.append_from_session("a", keys, values, np.ones(3, np.bool_))
    cache = _cache()
    cache.add_sequence("a")
    with pytest.raises(ValueError, match="nothing new"):
        cache.append_from_session("a", keys, values, np.zeros(3, np.bool_))
    assert cache.length("a") == 0


class _Buffer:
    """What ``append_in_buffer`` reads of an in-place buffer (``engine.model.in_place.KVBuffer``,
    whose session binding is irrelevant here): per layer ``[1, heads, capacity, dim]``."""

    def __init__(self, capacity: int, seed: int) -> None:
        self.keys, self.values = _kv(capacity, seed=seed, batch_axis=True)


def test_an_in_place_buffer_becomes_the_session_copy_read_lazily_and_rewound_by_length():
    cache = _cache()
    cache.add_sequence("a")
    buffer = _Buffer(12, seed=5)
    cache.append_in_buffer("a", buffer, 6)
    past = cache.session_past("a", compact=False)
    assert past.buffer is buffer and past.dead == 0 and past.keys[1].shape == (1, 3, 6, 16)
    assert np.shares_memory(past.keys[0], buffer.keys[0])  # views of the buffer, not copies
    cache.append_in_buffer("a", buffer, 9)  # the next call wrote slots 6..8 in place
    assert cache.length("a") == 9 and len(cache.block_table("a")) == 3
    cache.rewind("a", 7)
    past = cache.session_past("a", compact=False)
    assert past.alive.tolist() == [True] * 7 + [False] * 2 and past.dead == 2
    np.testing.assert_array_equal(cache.materialize("a")[1][1], buffer.values[1][:, :, :7])  # pools = buffer prefix


def test_a_tree_paths_rewind_moves_it_down_an_in_place_buffer_which_stays_a_prefix():
    """An in-place call writes after the live slots, so a kept path moves down to follow
    the committed tokens; the pools, a layer's slice and the next call all see the path."""
    cache = _cache()
    cache.add_sequence("a")
    buffer = _Buffer(16, seed=8)
    before = [k.copy() for k in buffer.keys], [v.copy() for v in buffer.values]
    cache.append_in_buffer("a", buffer, 10)  # 4 committed tokens, then a tree of 6 nodes
    cache.rewind("a", 4, [5, 7, 9])
    kept = [0, 1, 2, 3, 5, 7, 9]
    past = cache.session_past("a", compact=False)
    assert cache.length("a") == 7 and past.buffer is buffer and past.alive.tolist() == [True] * 7 + [False] * 3
    for layer in range(len(GEOMETRY)):
        np.testing.assert_array_equal(buffer.keys[layer][:, :, :7], before[0][layer][:, :, kept])
        np.testing.assert_array_equal(cache.slice("a", layer)[1], before[1][layer][:, :, kept])
        np.testing.assert_array_equal(cache.materialize("a")[layer][0], before[0][layer][:, :, kept])
    assert len(cache.block_table("a")) == 2
    cache.append_in_buffer("a", buffer, 9)  # the next call wrote slots 7, 8 right after the path
    assert cache.length("a") == 9 and len(cache.block_table("a")) == 3


def test_a_path_rewind_is_refused_when_it_is_not_a_path_after_the_kept_tokens():
    cache = _cache()
    cache.add_sequence("a")
    cache.append("a", *_kv(8, seed=9))
    for path in ([6, 5], [3, 6], [5, 8], [5, 5]):
        with pytest.raises(ValueError, match="path"):
            cache.rewind("a", 4, path)
    assert cache.length("a") == 8
    windowed = _cache(sliding_window=6, sink_tokens=2)
    windowed.add_sequence("a")
    windowed.append("a", *_kv(8, seed=9))
    with pytest.raises(ValueError, match="evicted"):
        windowed.rewind("a", 4, [5])


def test_in_place_appends_are_refused_when_nothing_is_new_or_the_buffer_does_not_fit():
    cache = _cache()
    cache.add_sequence("a")
    cache.append_in_buffer("a", _Buffer(8, seed=6), 4)
    with pytest.raises(ValueError, match="nothing new"):
        cache.append_in_buffer("a", _Buffer(8, seed=6), 4)
    with pytest.raises(ValueError, match="cache geometry"):
        cache.append_in_buffer("a", _Buffer(8, seed=6), 9)  # more slots than the buffer holds
    wrong = _Buffer(8, seed=7)
    wrong.keys = wrong.keys[:1]
    with pytest.raises(ValueError, match="cache geometry"):
        cache.append_in_buffer("a", wrong, 6)
    assert cache.length("a") == 4 and len(cache.block_table("a")) == 1  # nothing changed
    windowed = _cache(sliding_window=6, sink_tokens=2)
    windowed.add_sequence("a")
    with pytest.raises(ValueError, match="sliding window"):
        windowed.append_in_buffer("a", _Buffer(8, seed=6), 3)


def test_capacity_error_is_typed_and_leaves_everything_intact():
    cache = _cache(num_blocks=4)
    cache.add_sequence("a")
    cache.add_sequence("b")
    cache.append("a", *_kv(6, 1))  # 2 blocks
    cache.append("b", *_kv(3, 2))  # 1 block
    before = {s: cache.materialize(s) for s in ("a", "b")}
    tables = {s: cache.block_table(s) for s in ("a", "b")}
    assert cache.blocks_needed("b", 9) == 2 and cache.free_blocks == 1
    with pytest.raises(KVCacheCapacityError) as info:
        cache.append("b", *_kv(9, 3))  # needs 2 more blocks, 1 free
    assert isinstance(info.value, KVCacheError)
    assert "needs 2" in str(info.value) and "only 1" in str(info.value)
    assert cache.free_blocks == 1 and cache.used_blocks == 3
    for s in ("a", "b"):
        assert cache.length(s) == (6 if s == "a" else 3)
        assert cache.block_table(s) == tables[s]
        for (k, v), (k0, v0) in zip(cache.materialize(s), before[s]):
            assert k.tobytes() == k0.tobytes() and v.tobytes() == v0.tobytes()


def test_append_accepts_batch_axis_and_round_trips():
    cache = _cache()
    cache.add_sequence(0)
    k1, v1 = _kv(5, 1, batch_axis=True)
    k2, v2 = _kv(2, 2)
    cache.append(0, k1, v1)
    cache.append(0, k2, v2)
    assert cache.length(0) == 7 and cache.block_table(0) == [0, 1]
    for layer, (k, v) in enumerate(cache.materialize(0)):
        assert np.array_equal(k, np.concatenate([k1[layer], k2[layer][None]], axis=2))
        assert np.array_equal(v, np.concatenate([v1[layer], v2[layer][None]], axis=2))


def test_rewind_frees_whole_blocks_only():
    cache = _cache()
    cache.add_sequence("a")
    keys, values = _kv(10, 1)  # 3 blocks: slots 0-3, 4-7, 8-9
    cache.append("a", keys, values)
    assert cache.free_blocks == 5
    cache.rewind("a", 5)  # still touches block 1
    assert cache.free_blocks == 6 and cache.length("a") == 5 and len(cache.block_table("a")) == 2
    cache.rewind("a", 4)
    assert cache.free_blocks == 7
    k, v = cache.slice("a", 1)
    assert np.array_equal(k[0], keys[1][:, :4]) and np.array_equal(v[0], values[1][:, :4])
    cache.rewind("a", 0)
    assert cache.free_blocks == 8 and cache.block_table("a") == [] and cache.length("a") == 0


def test_rewind_out_of_range_raises():
    cache = _cache()
    cache.add_sequence("a")
    cache.append("a", *_kv(3, 1))
    with pytest.raises(ValueError, match="rewind"):
        cache.rewind("a", 4)
    with pytest.raises(ValueError, match="rewind"):
        cache.rewind("a", -1)
    assert cache.length("a") == 3


def test_free_returns_all_blocks():
    cache = _cache()
    cache.add_sequence("a")
    cache.add_sequence("b")
    cache.append("a", *_kv(9, 1))
    cache.append("b", *_kv(2, 2))
    assert cache.used_blocks == 4
    cache.free("a")
    assert cache.used_blocks == 1 and cache.free_blocks == 7
    assert cache.sequences() == ["b"] and not cache.has_sequence("a")
    with pytest.raises(UnknownSequenceError):
        cache.length("a")


def test_shape_mismatch_names_the_layer_and_changes_nothing():
    cache = _cache()
    cache.add_sequence("a")
    keys, values = _kv(3, 1)
    bad_values = [values[0], np.zeros((3, 3, 8), np.float32)]  # layer 1 wants head_dim 16
    with pytest.raises(ValueError, match=r"layer 1 values.*\(3, 3, 16\).*\(3, 3, 8\)"):
        cache.append("a", keys, bad_values)
    mismatched_n = [keys[0], _kv(2, 2)[0][1]]
    with pytest.raises(ValueError, match="layer 1 keys"):
        cache.append("a", mismatched_n, values)
    with pytest.raises(ValueError, match="2 layers"):
        cache.append("a", keys[:1], values[:1])
    assert cache.length("a") == 0 and cache.used_blocks == 0


def test_slice_out_of_range_layer():
    cache = _cache()
    cache.add_sequence("a")
    cache.append("a", *_kv(2, 1))
    with pytest.raises(IndexError, match=r"layer 2 .*2 layers"):
        cache.slice("a", 2)
    with pytest.raises(IndexError, match=r"layer -1 "):
        cache.slice("a", -1)


def test_per_layer_geometry():
    cache = _cache()
    cache.add_sequence("a")
    assert [k.shape for k, _ in cache.materialize("a")] == [(1, 2, 0, 8), (1, 3, 0, 16)]
    cache.append("a", *_kv(5, 1))
    assert cache.slice("a", 0)[0].shape == (1, 2, 5, 8)
    assert cache.slice("a", 1)[1].shape == (1, 3, 5, 16)


def test_cache_dtype_is_kept():
    cache = _cache(dtype=np.float16)
    cache.add_sequence("a")
    keys, values = _kv(3, 1)
    cache.append("a", keys, values)
    k, v = cache.slice("a", 0)
    assert k.dtype == np.float16 and np.array_equal(k[0], keys[0].astype(np.float16))


def test_unknown_sequence():
    cache = _cache()
    for call in (lambda: cache.length("x"), lambda: cache.materialize("x"), lambda: cache.rewind("x", 0),
                 lambda: cache.append("x", *_kv(1, 1)), lambda: cache.block_table("x"),
                 lambda: cache.blocks_needed("x", 1), lambda: cache.free("x")):
        with pytest.raises(UnknownSequenceError, match="'x'") as info:
            call()
        assert isinstance(info.value, KeyError) and isinstance(info.value, KVCacheError)
    cache.add_sequence("x")
    with pytest.raises(ValueError, match="already exists"):
        cache.add_sequence("x")


def test_sliding_window_keeps_sinks_and_recent_and_frees_evicted_blocks():
    cache = _cache(num_blocks=8, sliding_window=6, sink_tokens=2)
    cache.add_sequence("a")
    keys, values = _kv(20, 1)
    for t in range(20):  # token by token, like decoding
        cache.append("a", [k[:, t:t + 1] for k in keys], [v[:, t:t + 1] for v in values])
    assert cache.length("a") == 6 and cache.dropped_tokens("a") == 14
    keep = [0, 1, 16, 17, 18, 19]
    for layer, (k, v) in enumerate(cache.materialize("a")):
        assert np.array_equal(k[0], keys[layer][:, keep]) and np.array_equal(v[0], values[layer][:, keep])
    # physical slots 0..19 -> 5 blocks; evicted slots 2..15 make blocks 1, 2, 3 holes.
    table = cache.block_table("a")
    assert [b is None for b in table] == [False, True, True, True, False]
    assert cache.used_blocks == 2
    cache.apply_sliding_window("a")  # idempotent
    assert cache.used_blocks == 2 and cache.length("a") == 6

    cache.rewind("a", 3)  # keep sinks + token 16
    assert cache.dropped_tokens("a") == 14 and cache.used_blocks == 2
    k, _ = cache.slice("a", 0)
    assert np.array_equal(k[0], keys[0][:, [0, 1, 16]])
    cache.rewind("a", 1)  # into the sinks: the gap no longer matters
    assert cache.dropped_tokens("a") == 0 and cache.block_table("a") == [table[0]] and cache.used_blocks == 1


def test_window_prefill_longer_than_window_needs_only_surviving_blocks():
    cache = _cache(num_blocks=3, sliding_window=6, sink_tokens=2)
    cache.add_sequence("a")
    keys, values = _kv(30, 1)
    assert cache.blocks_needed("a", 30) == 3  # blocks 0 (sinks), 6 and 7 (slots 24..29)
    cache.append("a", keys, values)
    assert cache.free_blocks == 0 and cache.length("a") == 6
    k, v = cache.slice("a", 1)
    assert np.array_equal(k[0], keys[1][:, [0, 1, 26, 27, 28, 29]])


def test_full_pool_keeps_decoding_under_window():
    # Eviction frees a block before the append allocates one, so a full pool does not stall.
    # Window 9 with block 4: every append that opens a new block also completes an evicted one.
    cache = _cache(num_blocks=3, sliding_window=9, sink_tokens=0)
    cache.add_sequence("a")
    cache.append("a", *_kv(12, 1))
    assert cache.free_blocks == 0 and cache.length("a") == 9
    for t in range(20):
        assert cache.blocks_needed("a", 1) == 0
        cache.append("a", *_kv(1, 100 + t))
        assert cache.length("a") == 9 and cache.used_blocks == 3


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_blocks=0), "num_blocks"),
    (dict(block_size=0), "block_size"),
    (dict(sink_tokens=-1), "sink_tokens"),
    (dict(sliding_window=4, sink_tokens=4), "sliding_window"),
    (dict(sliding_window=0), "sliding_window"),
])
def test_bad_constructor_args(kwargs, name):
    with pytest.raises(ValueError, match=name):
        _cache(**kwargs)


def test_empty_layers_rejected():
    with pytest.raises(ValueError, match="layers"):
        PagedKVCache([], num_blocks=1)


def test_reserved_blocks_are_used_in_order_returned_on_rewind_and_never_shared():
    cache = PagedKVCache([LayerGeometry(1, 2)], num_blocks=8, block_size=2)
    cache.add_sequence("granted", reserved=[5, 2, 7])
    assert cache.free_blocks == 5  # the grant left the pool at once
    cache.add_sequence("other")
    kv = lambda n: ([np.ones((1, 1, n, 2), np.float32)], [np.ones((1, 1, n, 2), np.float32)])
    cache.append("granted", *kv(3))
    assert cache.block_table("granted") == [5, 2]
    cache.append("other", *kv(6))
    assert not {5, 2, 7} & set(cache.block_table("other"))
    cache.rewind("granted", 1)
    assert cache.block_table("granted") == [5]
    cache.append("granted", *kv(5))  # 6 tokens: exactly the grant, in the granted order
    assert cache.block_table("granted") == [5, 2, 7]
    with pytest.raises(KVCacheCapacityError, match="reserved"):
        cache.blocks_needed("granted", 1)
    with pytest.raises(KVCacheCapacityError, match="reserved"):
        cache.append("granted", *kv(1))
    assert cache.length("granted") == 6  # the failed append changed nothing
    cache.free("granted")
    cache.free("other")
    assert cache.free_blocks == 8


def test_a_reservation_of_blocks_in_use_is_refused():
    cache = PagedKVCache([LayerGeometry(1, 2)], num_blocks=4, block_size=2)
    cache.add_sequence("a")
    cache.append("a", [np.ones((1, 1, 2, 2), np.float32)], [np.ones((1, 1, 2, 2), np.float32)])
    used = cache.block_table("a")[0]
    with pytest.raises(KVCacheCapacityError, match="not all free"):
        cache.add_sequence("b", reserved=[used])
    assert not cache.has_sequence("b") and cache.free_blocks == 3


# ---------------------------------------------------------------------- the block ledger and admission


def test_the_ledger_reserves_whole_requests_on_the_roomiest_pool_and_refuses_what_never_fits():
    ledger = BlockLedger()
    ledger.register_pool("a", num_blocks=4, block_size=16)
    ledger.register_pool("b", num_blocks=8, block_size=16)
    first = ledger.try_admit("s1", 40)               # 3 blocks, on the larger pool
    assert first.replica == "b" and len(first.blocks) == 3
    assert ledger.try_admit("s2", 64).replica == "b"  # b still has 5 free, a has 4
    assert ledger.try_admit("s3", 64).replica == "a"
    assert ledger.try_admit("s4", 40) is None         # 1 + 0 free: wait
    with pytest.raises(AdmissionError, match="more KV than any"):
        ledger.try_admit("huge", 16 * 9)
    with pytest.raises(ValueError, match="already admitted"):
        ledger.try_admit("s1", 16)
    usage = ledger.usage()
    assert {k: usage[k] for k in ("replicas", "total_blocks", "free_blocks", "reserved_blocks", "sequences")} == {
        "replicas": 2, "total_blocks": 12, "free_blocks": 1, "reserved_blocks": 11, "sequences": 3}
    assert usage["per_replica"]["b"]["sequences"] == 2 and usage["per_replica"]["a"]["free_blocks"] == 0
    for seq in ("s1", "s2", "s3"):
        assert ledger.release(seq)
    assert ledger.usage()["free_blocks"] == 12 and not ledger.release("s1")
    assert ledger.try_admit("all of b", 16 * 8).replica == "b"  # every block of b is back


def test_a_rebuilt_ledger_never_grants_a_live_block_twice():
    ledger = BlockLedger()
    ledger.register_pool("a", num_blocks=6, block_size=16, live={"old": [0, 4]})
    assert ledger.usage()["free_blocks"] == 4
    grant = ledger.try_admit("new", 64)
    assert sorted(grant.blocks) == [1, 2, 3, 5]
    assert ledger.drop_pool("a") == ["old", "new"] and ledger.try_admit("later", 16) is None  # no pool: wait


def test_admission_waits_for_room_and_admits_when_a_request_leaves():
    async def scenario():
        admission = Admission(timeout_s=30)
        await admission.register_pool("p", num_blocks=4, block_size=16)
        running = await admission.admit("running", 48)           # 3 of 4 blocks
        waiting = asyncio.ensure_future(admission.admit("waiting", 32))
        for _ in range(5):
            await asyncio.sleep(0)                               # let it try (and wait)
        assert not waiting.done() and admission.usage()["sequences"] == 1
        assert await admission.release("running")
        grant = await asyncio.wait_for(waiting, 5)
        return running, grant, admission.usage()

    running, grant, usage = asyncio.run(scenario())
    assert len(grant.blocks) == 2 and set(grant.blocks) <= set(range(4))
    assert usage["free_blocks"] == 2 and usage["sequences"] == 1


def test_admission_gives_up_after_its_timeout_but_refuses_what_never_fits_at_once():
    async def scenario():
        admission = Admission(timeout_s=0.05)
        await admission.register_pool("p", num_blocks=4, block_size=16)
        await admission.admit("running", 48)
        with pytest.raises(AdmissionError, match="after waiting 0.05 s .1 of 4 blocks free, 1 sequences"):
            await admission.admit("late", 32)
        patient = Admission(timeout_s=3600)
        await patient.register_pool("p", num_blocks=4, block_size=16)
        with pytest.raises(AdmissionError, match="more KV than any"):
            await asyncio.wait_for(patient.admit("huge", 80), 5)  # at once, not after an hour
        return admission.usage()

    usage = asyncio.run(scenario())
    assert usage["free_blocks"] == 1 and usage["sequences"] == 1  # the failed admission took nothing
