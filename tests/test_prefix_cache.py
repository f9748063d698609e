"""Prefix caching in the paged KV cache and the block ledger, without a model: a
hypothesis state machine shares, publishes, rewinds, evicts and frees against a
reference in which a token's KV is a function of the tokens up to it (so sharing is
correct exactly when the data matches), and unit tests of the ledger's accounting,
its agreement with the pool, and the replica choice."""
from __future__ import annotations

import hashlib
import random
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from specserve.engine.kv.block_ledger import BlockLedger
from specserve.engine.kv.paged_cache import KVCacheCapacityError, KVCacheError, LayerGeometry, PagedKVCache
from specserve.engine.kv.block_pool import BlockPool
from specserve.engine.kv.prefix_cache import block_hashes, cacheable_blocks
from specserve.engine.kv.replica_choice import IMBALANCE

GEOMETRY = (LayerGeometry(num_kv_heads=2, head_dim=4), LayerGeometry(num_kv_heads=1, head_dim=8))
BLOCK = 4
_KV: dict[tuple[int, ...], list[tuple[np.ndarray, np.ndarray]]] = {}


def _token_kv(prefix: tuple[int, ...]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The KV of the last token of ``prefix``: a function of every token up to it, as a
    model's is (so two sequences may share a block exactly when their prefixes agree)."""
    if prefix not in _KV:
        seed = int.from_bytes(hashlib.blake2b(np.asarray(prefix, np.int64).tobytes(), digest_size=8).digest(), "little")
        rng = np.random.default_rng(seed)
        _KV[prefix] = [(rng.standard_normal((g.num_kv_heads, 1, g.head_dim)).astype(np.float32),
                        rng.standard_normal((g.num_kv_heads, 1, g.head_dim)).astype(np.float32)) for g in GEOMETRY]
    return _KV[prefix]


def _kv_of(tokens: list[int], start: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per layer ``[heads, n, dim]`` keys and values of ``tokens[start:]`` after ``tokens[:start]``."""
    per_token = [_token_kv(tuple(tokens[: p + 1])) for p in range(start, len(tokens))]
    keys = [np.concatenate([t[layer][0] for t in per_token], axis=1) for layer in range(len(GEOMETRY))]
    values = [np.concatenate([t[layer][1] for t in per_token], axis=1) for layer in range(len(GEOMETRY))]
    return keys, values


TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=14)  # two token values: prefixes collide often


class SharingCacheMachine(RuleBasedStateMachine):
    """Start sequences on cached prefixes, append (dense and in the session's layout),
    publish, rewind, free and reset on a small pool, and check after every step: each
    sequence reads the KV of its own tokens, every named block still holds the KV of the
    tokens it is named for (shared blocks never change), a rewind into a named block is
    refused and changes nothing, and every block is free, cached or held by exactly the
    sequences whose tables list it (a shared block counted once)."""

    NUM_BLOCKS = 6
    SEQ_IDS = st.sampled_from(["a", "b", "c", "d"])

    def __init__(self):
        super().__init__()
        self.cache = PagedKVCache(GEOMETRY, num_blocks=self.NUM_BLOCKS, block_size=BLOCK, prefix_caching=True)
        self.tokens: dict[str, list[int]] = {}
        self.final: dict[str, int] = {}  # tokens whose KV is final (published up to)
        self.named: dict[int, tuple[int, ...]] = {}  # block name -> the tokens up to that block's end
        self.reset_while_live: set[str] = set()  # their first blocks' names are gone: nothing of theirs is found
        self.seen: list[list[int]] = []  # every sequence's tokens when it published

    def _published_prefixes(self, tokens: list[int]) -> int:
        """Longest prefix of ``tokens`` in blocks a live sequence has named (which no
        eviction can take while it holds them)."""
        best = 0
        for sid, own in self.tokens.items():
            if sid in self.reset_while_live:
                continue
            n = min(self.final[sid], self.cache.frozen_tokens(sid))
            common = 0
            while common < min(n, len(tokens)) and own[common] == tokens[common]:
                common += 1
            best = max(best, common // BLOCK * BLOCK)
        return best

    @initialize(tokens=st.lists(st.integers(0, 1), min_size=8, max_size=13))
    def a_published_prompt(self, tokens):
        self.cache.add_sequence("a")
        self.cache.append("a", *_kv_of(tokens))
        self.tokens["a"], self.final["a"] = list(tokens), 0
        self.publish_upto("a", len(tokens))

    @rule(sid=SEQ_IDS, data=st.data(), suffix=TOKENS)
    def start(self, sid, data, suffix):
        """A new sequence; mostly one that repeats part of a sequence seen before."""
        if sid in self.tokens:
            return
        tokens = suffix
        if data.draw(st.integers(0, 3)):
            base = data.draw(st.sampled_from(self.seen))
            tokens = base[: data.draw(st.integers(0, len(base)))] + suffix
        held_prefix = self._published_prefixes(tokens)
        self.cache.add_sequence(sid)
        shared = self.cache.share_prefix(sid, tokens)
        assert shared % BLOCK == 0 and shared <= cacheable_blocks(len(tokens), BLOCK) * BLOCK
        assert shared >= min(held_prefix, cacheable_blocks(len(tokens), BLOCK) * BLOCK)  # what is held is found
        event(f"started on {shared // BLOCK} shared blocks")
        self.tokens[sid], self.final[sid] = tokens[:shared], shared
        if self.cache.blocks_needed(sid, len(tokens) - shared) > self.cache.free_blocks:
            with pytest.raises(KVCacheCapacityError):
                self.cache.append(sid, *_kv_of(tokens, shared))
            return
        self.cache.append(sid, *_kv_of(tokens, shared))
        self.tokens[sid] = list(tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=TOKENS, session=st.booleans())
    def append(self, data, new, session):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[sid] + new
        if self.cache.blocks_needed(sid, len(new)) > self.cache.free_blocks:
            return
        keys, values = _kv_of(tokens, len(self.tokens[sid]))
        if session:  # the decoder's path: the session's whole output, new tokens pending in it
            past = self.cache.session_past(sid)
            keys = [np.concatenate([k, n[None]], axis=2) for k, n in zip(past.keys, keys)]
            values = [np.concatenate([v, n[None]], axis=2) for v, n in zip(past.values, values)]
            self.cache.append_from_session(sid, keys, values, np.concatenate([past.alive, np.ones(len(new), bool)]))
        else:
            self.cache.append(sid, keys, values)
        self.tokens[sid] = tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def publish(self, data):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.publish_upto(sid, data.draw(st.integers(0, len(self.tokens[sid]))))

    def publish_upto(self, sid, upto):
        self.seen.append(list(self.tokens[sid]))
        named = self.cache.publish(sid, self.tokens[sid][:upto])
        assert named * BLOCK == self.cache.frozen_tokens(sid) >= upto // BLOCK * BLOCK
        self.final[sid] = max(self.final[sid], upto)
        names = block_hashes(self.tokens[sid], BLOCK, count=named)
        self.named.update({name: tuple(self.tokens[sid][: (i + 1) * BLOCK]) for i, name in enumerate(names)})

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def rewind(self, data):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        length = data.draw(st.integers(0, len(self.tokens[sid])))
        frozen = self.cache.frozen_tokens(sid)
        if length < frozen:
            table, free = self.cache.block_table(sid), self.cache.free_blocks
            with pytest.raises(KVCacheError, match="immutable"):
                self.cache.rewind(sid, length)
            assert self.cache.block_table(sid) == table and self.cache.free_blocks == free
            return
        self.cache.rewind(sid, length)
        del self.tokens[sid][length:]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.cache.free(sid)
        del self.tokens[sid], self.final[sid]
        self.reset_while_live.discard(sid)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), spare=st.integers(0, 5))
    def read_into_a_buffer(self, data, spare):
        """What a call on the in-place graph does with a sequence that has no session copy
        (or replaces it): the past copied from the pools straight into its buffer."""
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        n = len(self.tokens[sid])
        keys = [np.full((1, g.num_kv_heads, n + spare, g.head_dim), np.nan, np.float32) for g in GEOMETRY]
        values = [k.copy() for k in keys]
        self.cache.read_into(sid, keys, values)
        if n:
            expected = _kv_of(self.tokens[sid])
            for layer in range(len(GEOMETRY)):
                assert np.array_equal(keys[layer][0, :, :n], expected[0][layer])
                assert np.array_equal(values[layer][0, :, :n], expected[1][layer])
        assert all(np.isnan(k[0, :, n:]).all() for k in keys)  # nothing written past the sequence

    @rule()
    def reset(self):
        cached = self.cache.cached_blocks
        assert self.cache.reset_prefix_cache() == cached
        assert self.cache.cached_blocks == 0 and self.cache.block_names() == {}
        self.reset_while_live.update(self.tokens)

    @invariant()
    def each_named_block_holds_what_it_is_named_for(self):
        """In the pools, checked before anything reads a sequence (which would write its pending KV
        out): hypothesis runs invariants in name order."""
        for block, name in self.cache.block_names().items():
            tokens = list(self.named[name])
            keys, values = _kv_of(tokens, len(tokens) - BLOCK)
            for layer in range(len(GEOMETRY)):
                assert np.array_equal(self.cache._tables.key_pools[layer][block], keys[layer])
                assert np.array_equal(self.cache._tables.value_pools[layer][block], values[layer])

    @invariant()
    def every_sequence_reads_its_own_tokens_kv(self):
        for sid, tokens in self.tokens.items():
            assert self.cache.length(sid) == len(tokens)
            expected = _kv_of(tokens) if tokens else None
            for layer, (k, v) in enumerate(self._read(sid)):
                if expected is None:
                    assert k.shape[2] == 0
                else:
                    assert np.array_equal(k[0], expected[0][layer]) and np.array_equal(v[0], expected[1][layer])

    def _read(self, sid):
        """The sequence's KV as a model call would read it, without writing pending KV to
        the pools (which ``materialize`` does, and would hide a publish that forgot to)."""
        kept = self.cache.kept_session(sid)
        if kept is None:
            return self.cache.materialize(sid)  # nothing pending without a session copy
        live = kept.live()
        return [(k[:, :, live], v[:, :, live]) for k, v in zip(kept.keys, kept.values)]

    @invariant()
    def every_block_is_free_cached_or_held_by_its_tables(self):
        cache = self.cache
        held = Counter(b for sid in self.tokens for b in cache.block_table(sid) if b is not None)
        assert cache._tables.blocks.holders == dict(held)
        assert cache.used_blocks == len(held) and cache.free_blocks + cache.used_blocks == cache.num_blocks
        assert cache.cached_blocks == sum(1 for b in cache.block_names() if b not in held)
        for sid in self.tokens:
            assert cache.frozen_tokens(sid) <= cache.length(sid)


TestSharingCache = SharingCacheMachine.TestCase
TestSharingCache.settings = settings(max_examples=150, stateful_step_count=30, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------- the cache


def _cache(num_blocks: int = 8, **kw) -> PagedKVCache:
    return PagedKVCache(GEOMETRY, num_blocks=num_blocks, block_size=BLOCK, prefix_caching=True, **kw)


def test_block_names_chain_so_one_earlier_token_changes_every_later_name():
    tokens = list(range(12))
    names = block_hashes(tokens, 4)
    assert len(names) == 3 and names == block_hashes(tokens + [99], 4)  # only full blocks are named
    other = block_hashes([7] + tokens[1:], 4)
    assert all(a != b for a, b in zip(names, other))  # the first block differs, and so every one after it
    assert block_hashes(tokens, 4, names[0], first=1, count=1) == names[1:2]  # resumable from a parent
    assert [cacheable_blocks(n, 4) for n in (1, 4, 5, 8, 9)] == [0, 0, 1, 1, 2]  # the last token is always fed


def test_a_later_prompt_shares_the_published_blocks_and_feeds_only_the_rest():
    cache = _cache()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    cache.add_sequence("first")
    cache.append("first", *_kv_of(prompt))
    assert cache.publish("first", prompt) == 2 and cache.frozen_tokens("first") == 8
    cache.add_sequence("second")
    assert cache.share_prefix("second", prompt[:8] + [11, 12]) == 8
    assert cache.block_table("second") == cache.block_table("first")[:2] and cache.used_blocks == 3
    cache.add_sequence("same")
    assert cache.share_prefix("same", prompt[:8]) == 4  # a prompt of exactly 8 tokens still feeds its last block
    cache.add_sequence("other")
    assert cache.share_prefix("other", [9] + prompt[1:]) == 0
    with pytest.raises(ValueError, match="already holds KV"):
        cache.share_prefix("first", prompt)


def test_a_freed_sequences_blocks_stay_cached_and_are_reused_least_recently_used_first():
    cache = _cache(num_blocks=4)
    for sid, tokens in (("old", [1] * 5), ("new", [2] * 5)):
        cache.add_sequence(sid)
        cache.append(sid, *_kv_of(tokens))
        cache.publish(sid, tokens)
        cache.free(sid)
    assert cache.free_blocks == 4 and cache.cached_blocks == 2  # cached blocks count as free
    cache.add_sequence("big")
    cache.append("big", *_kv_of([3] * 12))  # 3 blocks: the 2 free ones, then the older cached one
    cache.add_sequence("again")
    assert cache.share_prefix("again", [1] * 5) == 0 and cache.share_prefix("again", [2] * 5) == 4


def test_a_grant_may_name_cached_blocks_and_a_grant_of_wrong_blocks_is_refused():
    cache = _cache(num_blocks=4)
    cache.add_sequence("first")
    cache.append("first", *_kv_of([5] * 8))
    cache.publish("first", [5] * 8)
    block = cache.block_table("first")[0]
    cache.free("first")
    cache.add_sequence("hit", reserved=[3])
    with pytest.raises(KVCacheError, match="disagree"):
        cache.share_prefix("hit", [6] * 8, [block])  # the block holds other tokens' KV
    assert cache.share_prefix("hit", [5] * 6, [block]) == 4 and cache.block_table("hit") == [block]
    cache.append("hit", *_kv_of([5] * 6, 4))
    assert cache.block_table("hit") == [block, 3]
    cache.add_sequence("evicts", reserved=[1])  # a cached block granted as a reservation: it is evicted
    assert 1 not in cache.block_names() and cache.cached_blocks == 0
    with pytest.raises(KVCacheCapacityError, match="not all free"):
        cache.add_sequence("taken", reserved=[3])


def test_rewinds_stop_at_the_shared_prefix_and_copy_on_write_is_never_needed():
    """Named blocks are full and immutable: the only writes after them are appends past a
    sequence's end, and a rewind that would reach into them is refused, unchanged."""
    cache = _cache()
    prompt = list(range(9))
    cache.add_sequence("a")
    cache.append("a", *_kv_of(prompt))
    cache.publish("a", prompt)
    cache.add_sequence("b")
    cache.share_prefix("b", prompt)
    cache.append("b", *_kv_of(prompt + [1, 1, 1], 8))
    cache.rewind("b", 8)  # down to the shared prefix: fine
    with pytest.raises(KVCacheError, match="immutable"):
        cache.rewind("b", 7)
    assert cache.length("b") == 8 and cache.frozen_tokens("b") == 8
    np.testing.assert_array_equal(cache.materialize("b")[0][0][0], _kv_of(prompt[:8])[0][0])


def test_the_window_refuses_prefix_caching():
    with pytest.raises(ValueError, match="full-attention"):
        PagedKVCache(GEOMETRY, num_blocks=4, block_size=BLOCK, sliding_window=8, prefix_caching=True)
    plain = PagedKVCache(GEOMETRY, num_blocks=4, block_size=BLOCK)
    plain.add_sequence("a")
    plain.append("a", *_kv_of([1] * 8))
    assert plain.publish("a", [1] * 8) == 0 and plain.block_names() == {}
    from specserve.engine.config import EngineConfig
    with pytest.raises(ValueError, match="prefix_caching needs a full-attention"):
        EngineConfig(sliding_window=64, prefix_caching=True)
    assert not EngineConfig(sliding_window=64).caches_prefixes and EngineConfig().caches_prefixes


# ---------------------------------------------------------------------- the ledger


def _published(ledger: BlockLedger, seq: str, prompt: list[int], tokens: int, avoid=()):
    grant = ledger.try_admit(seq, tokens, avoid, prompt)
    ledger.publish(seq, prompt)
    return grant


def test_admission_counts_a_shared_block_once_and_reserves_only_the_rest():
    ledger = BlockLedger()
    ledger.register_pool("r", num_blocks=10, block_size=4)
    prompt = list(range(17))  # 4 full blocks; a hit may take at most 4 (the 17th token is fed)
    first = _published(ledger, "first", prompt, 24)
    assert first.prefix_blocks == 0 and len(first.blocks) == 6
    second = ledger.try_admit("second", 24, prefix=prompt)
    assert second.prefix_blocks == 4 and second.cached_tokens == 16 and second.blocks[:4] == first.blocks[:4]
    assert ledger.usage()["reserved_blocks"] == 8  # 6 + 2 new: the 4 shared ones counted once
    assert ledger.try_admit("third", 24, prefix=prompt).prefix_blocks == 4  # the last 2 free blocks
    assert ledger.try_admit("fourth", 24, prefix=prompt) is None  # 2 more wanted, none left: wait
    assert ledger.try_admit("cold", 4) is None
    for seq in ("first", "second", "third"):
        assert ledger.release(seq)
    usage = ledger.usage()
    assert usage["free_blocks"] == 10 and usage["cached_blocks"] == 4 and usage["sequences"] == 0


def test_a_release_with_its_final_tokens_caches_them_and_a_reset_frees_every_cached_block():
    ledger = BlockLedger()
    ledger.register_pool("r", num_blocks=16, block_size=4)
    prompt = [3, 1, 4, 1, 5]
    ledger.try_admit("turn 1", 16, prefix=prompt)
    ledger.publish("turn 1", prompt)  # 1 full block
    answer = prompt + [9, 2, 6, 5, 3, 5]  # the committed tokens whose KV is final: 2 full blocks
    assert ledger.release("turn 1", answer)
    assert ledger.usage()["cached_blocks"] == 2
    assert ledger.try_admit("turn 2", 32, prefix=answer + [8, 9, 7]).cached_tokens == 8  # the conversation so far
    assert ledger.reset_prefix_cache() == 0  # both cached blocks are held by turn 2 now: nothing to free yet
    ledger.publish("turn 2", answer + [8, 9, 7])  # a sequence running across a reset names nothing again
    assert ledger.release("turn 2", answer + [8, 9, 7, 1])
    assert ledger.usage()["cached_blocks"] == 0 and ledger.try_admit("turn 3", 16, prefix=answer).cached_tokens == 0


class LedgerAndPoolMachine(RuleBasedStateMachine):
    """The coordinator's protocol between the ledger and a target pool, in lockstep:
    admit (sharing the grant's cached blocks on the pool), prefill, decode, publish (the
    target first, and sometimes only the target: a prefill that failed after computing),
    release, and reset the ledger alone. Every block the ledger names holds that KV on
    the pool, and the two agree on which blocks are held."""

    def __init__(self):
        super().__init__()
        self.ledger = BlockLedger()
        self.ledger.register_pool("r", num_blocks=8, block_size=BLOCK)
        self.pool = PagedKVCache(GEOMETRY, num_blocks=8, block_size=BLOCK, prefix_caching=True)
        self.tokens: dict[str, list[int]] = {}
        self.budget: dict[str, int] = {}
        self.ids = 0

    @rule(prompt=TOKENS, extra=st.integers(0, 6), told=st.booleans())
    def admit_and_prefill(self, prompt, extra, told):
        sid, self.ids = f"s{self.ids}", self.ids + 1
        grant = self.ledger.try_admit(sid, len(prompt) + extra, prefix=prompt)
        if grant is None:
            return
        self.pool.add_sequence(sid, grant.blocks[grant.prefix_blocks:])
        start = self.pool.share_prefix(sid, prompt, grant.blocks[: grant.prefix_blocks]) if grant.prefix_blocks else 0
        assert start == grant.cached_tokens
        self.pool.append(sid, *_kv_of(prompt, start))
        self.pool.publish(sid, prompt)
        if told:
            self.ledger.publish(sid, prompt)
        self.tokens[sid], self.budget[sid] = list(prompt), len(prompt) + extra

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), token=st.integers(0, 1))
    def decode(self, data, token):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        if len(self.tokens[sid]) < self.budget[sid]:
            self.tokens[sid].append(token)
            self.pool.append(sid, *_kv_of(self.tokens[sid], len(self.tokens[sid]) - 1))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), with_tokens=st.booleans())
    def release(self, data, with_tokens):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens.pop(sid)
        self.pool.publish(sid, tokens)
        self.pool.free(sid)
        assert self.ledger.release(sid, tokens if with_tokens else None)

    @rule()
    def reset_the_ledger(self):
        self.ledger.reset_prefix_cache()

    @invariant()
    def the_ledger_names_only_what_the_pool_holds(self):
        ledger_pool = self.ledger._pools["r"].blocks
        target_names = self.pool.block_names()
        assert all(target_names.get(block) == name for block, name in ledger_pool.names.items())
        assert set(ledger_pool.holders) == {b for s in self.tokens for b in self.pool.owned_blocks(s)}
        assert self.ledger.usage()["free_blocks"] == self.pool.free_blocks


TestLedgerAndPool = LedgerAndPoolMachine.TestCase
TestLedgerAndPool.settings = settings(max_examples=120, stateful_step_count=30, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])


def test_a_rebuilt_ledger_keeps_the_pools_cached_prefixes_and_their_holders():
    pool = _cache(num_blocks=6)
    prompt = [2, 7, 1, 8, 2, 8, 1, 8, 2]
    pool.add_sequence("live")
    pool.append("live", *_kv_of(prompt))
    pool.publish("live", prompt)
    ledger = BlockLedger()
    ledger.register_pool("r", 6, BLOCK, live={"live": pool.owned_blocks("live")}, names=pool.block_names())
    grant = ledger.try_admit("new", 12, prefix=prompt)
    assert grant.prefix_blocks == 2 and grant.blocks[:2] == pool.block_table("live")[:2]
    assert ledger.usage()["reserved_blocks"] == 4  # live's 3, and 1 more for new
    assert ledger.release("live", prompt) and ledger.release("new")
    assert ledger.usage() | {"per_replica": None} == {"replicas": 1, "total_blocks": 6, "free_blocks": 6,
                                                     "reserved_blocks": 0, "sequences": 0, "cached_blocks": 2,
                                                     "per_replica": None}


# ---------------------------------------------------------------------- the replica choice


def _two_replicas(routing="prefix_aware") -> BlockLedger:
    ledger = BlockLedger(routing)
    ledger.register_pool("r1", num_blocks=64, block_size=4)
    ledger.register_pool("r2", num_blocks=96, block_size=4)
    return ledger


def test_a_prompt_goes_to_the_replica_caching_its_longest_prefix_while_loads_are_balanced():
    ledger = _two_replicas()
    system = list(range(40))  # 10 full blocks
    assert _published(ledger, "warm", system + [1], 44).replica == "r2"  # no match anywhere: the roomiest
    for i in range(IMBALANCE):  # r2 holds "warm" and these: 1 + IMBALANCE sequences against r1's 0
        grant = ledger.try_admit(f"follow {i}", 44, prefix=system + [i])
        assert grant.replica == "r2" and grant.cached_tokens == 40, i
    assert ledger.try_admit("one too many", 44, prefix=system + [99]).replica == "r1"  # balanced against load
    for seq in ["one too many"] + [f"follow {i}" for i in range(IMBALANCE)]:
        ledger.release(seq)
    assert ledger.try_admit("filler", 4 * 30).replica == "r2"  # r2 (85 blocks it could grant) the roomiest
    # r2 can grant 55 now, r1 64: the match wins over room ...
    assert ledger.try_admit("match", 44, prefix=system + [5]).replica == "r2"
    ledger.release("match")
    # ... but 1 cached block of the 16 a prompt could use is under 10 %: the roomiest, r1
    assert ledger.try_admit("tiny match", 68, prefix=system[:5] + [7] * 60).replica == "r1"
    ledger.release("tiny match")
    assert ledger.try_admit("more filler", 4 * 55, avoid=["r1"]).replica == "r2"  # r2 has no room left ...
    assert ledger.try_admit("no room", 44, prefix=system + [3]).replica == "r1"  # ... so its match is not used


def test_round_robin_takes_the_replicas_in_turn_whatever_they_cache():
    ledger = _two_replicas("round_robin")
    system = list(range(40))
    replicas = [_published(ledger, f"s{i}", system + [i], 44).replica for i in range(4)]
    assert replicas == ["r1", "r2", "r1", "r2"]
    assert ledger.try_admit("s4", 44, prefix=system + [4]).cached_tokens == 40  # r1 has it from s0 and s2


def _hit_rate(routing: str, prefixes: int, per_prefix: int, blocks: int) -> float:
    """The routing bench's workload on the ledger alone: two replicas of ``blocks`` blocks of
    16, ``prefixes`` 750-token system prompts with ``per_prefix`` 40-token questions each,
    shuffled, two in flight; cached over prompt tokens."""
    ledger = BlockLedger(routing)
    for replica in ("r1", "r2"):
        ledger.register_pool(replica, num_blocks=blocks, block_size=16)
    jobs = [(k, i) for k in range(prefixes) for i in range(per_prefix)]
    random.Random(40).shuffle(jobs)
    asked = cached = 0
    live: list[tuple[int, list[int]]] = []
    for n, (k, i) in enumerate(jobs):
        prompt = [100_000 * (k + 1) + t for t in range(750)] + [7_000 + 50 * i + t for t in range(40)]
        grant = ledger.try_admit(n, len(prompt) + 16, prefix=prompt)
        ledger.publish(n, prompt)
        asked, cached = asked + len(prompt), cached + grant.cached_tokens
        live.append((n, prompt))
        if len(live) == 2:
            ledger.release(*live.pop(0))
    for seq, tokens in live:
        ledger.release(seq, tokens)
    assert ledger.usage()["free_blocks"] == ledger.usage()["total_blocks"]
    return cached / asked


def test_prefix_aware_routing_finds_more_of_the_prompts_cached_than_round_robin():
    """Round-robin makes every replica compute and cache every system prompt once; prefix
    awareness keeps each on one replica (bench/prefix_cache.py measures it served)."""
    aware, in_turn = _hit_rate("prefix_aware", 4, 4, 192), _hit_rate("round_robin", 4, 4, 192)
    assert aware > in_turn + 0.2, (aware, in_turn)


def test_a_dropped_replica_takes_its_cache_with_it():
    ledger = _two_replicas()
    system = list(range(40))
    _published(ledger, "s", system + [1], 44)
    assert ledger.drop_pool("r2") == ["s"]
    assert ledger.try_admit("resumed", 44, prefix=system + [1]).cached_tokens == 0
