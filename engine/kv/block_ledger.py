"""The allocation truth for the KV cache: which blocks of which target pool each
sequence holds, and which hold a cached prefix.

Target workers hold the physical pages; this ledger decides who gets which of them.
Admission reserves a sequence's worst case up front (``kv_reservation``) on one pool, so
a round can never run out of KV and the ledger is consulted once per request (admit,
publish, release) -- never on a round's critical path.

Prefix caching: the ledger keeps its own ``BlockPool`` per target pool, naming blocks by
their tokens (``kv.prefix_cache``). Admission looks the prompt up in every pool, grants
the blocks already holding its leading full blocks as shared (counted once however many
sequences hold them) and reserves only the rest, and ``ReplicaChooser`` weighs the
longest cached prefix against load. A block is named here only after its target
computed it: when the coordinator reports a finished prefill (``publish``) or releases
a sequence with its committed tokens, and the target names the same blocks first
(``TargetWorker``), so every block the ledger names holds that KV on its target (which
checks it). The target may name more (a prefill that failed after computing its
prompt); the ledger then never shares those, and reuses them as free.

Recovery does not need the ledger to know committed tokens: the coordinator holds
every request's committed tokens (it streams them), so a lost target pool costs a
re-prefill from those (its cache is gone with it), and a lost ledger is rebuilt from
the pools' live grants and named blocks (``register_pool(..., live=..., names=...)``).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Hashable, Sequence

from specserve.engine.kv.paged_cache import KVCacheCapacityError
from specserve.engine.kv.block_pool import BlockPool
from specserve.engine.kv.prefix_cache import ROOT_HASH, block_hashes, cacheable_blocks
from specserve.engine.kv.replica_choice import Candidate, ReplicaChooser, ReplicaRouting


class AdmissionError(KVCacheCapacityError):
    """The request cannot be given KV blocks (now, or ever)."""


@dataclass(frozen=True)
class Grant:
    replica: str
    blocks: list[int]     # in the sequence's table order: its shared blocks first, then its reservation
    prefix_blocks: int = 0  # leading blocks that already hold the prefix's KV (a prefix-cache hit)
    cached_tokens: int = 0  # the tokens they hold: what the prefill need not compute


@dataclass
class _Pool:
    num_blocks: int
    block_size: int
    blocks: BlockPool


@dataclass
class _Grant:
    replica: str
    blocks: list[int]
    named: int = 0          # leading blocks of ``blocks`` this ledger has named (shared or published)
    chain: int = ROOT_HASH  # the name of block ``named - 1``


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockLedger:
    def __init__(self, routing: ReplicaRouting = "prefix_aware") -> None:
        self._pools: dict[str, _Pool] = {}
        self._seqs: dict[Hashable, _Grant] = {}
        self._load: Counter[str] = Counter()  # replica -> sequences it holds
        self.chooser = ReplicaChooser(routing)

    # -- pools ---------------------------------------------------------------------------
    def register_pool(self, replica: str, num_blocks: int, block_size: int,
                      live: dict[Hashable, list[int]] | None = None, names: dict[int, int] | None = None,
                      prefix_caching: bool = True) -> None:
        """A target pool announces itself. ``live`` -- sequence -> its blocks, in table
        order -- and ``names`` -- block -> the named KV it holds -- restore what a pool
        already holds when the ledger itself was lost (a restarted KV manager), so no
        block is granted twice and cached prefixes stay shared."""
        self.drop_pool(replica)
        live = live or {}
        pool = _Pool(num_blocks, block_size, BlockPool(num_blocks, caching=prefix_caching))
        holders = Counter(b for blocks in live.values() for b in blocks)
        pool.blocks.restore(dict(holders), names or {})
        self._pools[replica] = pool
        for seq_id, blocks in live.items():
            # Its named blocks are named in the pool already; publishing more starts past
            # the ones it holds that have names (their chain is not needed: a leading run).
            self._seqs[seq_id] = _Grant(replica, list(blocks), *self._named_run(pool, blocks))
            self._load[replica] += 1

    @staticmethod
    def _named_run(pool: _Pool, blocks: Sequence[int]) -> tuple[int, int]:
        run = 0
        while run < len(blocks) and blocks[run] in pool.blocks.names:
            run += 1
        return run, pool.blocks.names[blocks[run - 1]] if run else ROOT_HASH

    def has_pool(self, replica: str) -> bool:
        return replica in self._pools

    def drop_pool(self, replica: str) -> list[Hashable]:
        """Forget a pool (its replica died, and its cache with it); returns the sequences
        that lived on it."""
        lost = [s for s, e in self._seqs.items() if e.replica == replica]
        for seq_id in lost:
            del self._seqs[seq_id]
        self._pools.pop(replica, None)
        self._load.pop(replica, None)
        return lost

    # -- sequences -----------------------------------------------------------------------
    def try_admit(self, seq_id: Hashable, tokens: int, avoid: Sequence[str] = (),
                  prefix: Sequence[int] = ()) -> Grant | None:
        """Reserve blocks for ``tokens`` on one pool (``ReplicaChooser``); None if none has
        room now. ``prefix``: the tokens the sequence's prefill will feed; the blocks
        already holding its leading full blocks are shared, not reserved again.

        Raises ``AdmissionError`` when no pool could ever hold the request."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already admitted")
        pools = {r: p for r, p in self._pools.items() if r not in avoid}
        if not pools:
            return None  # no live target pool yet (starting, or being replaced): wait
        fits_ever = [r for r, p in pools.items() if _ceil_div(tokens, p.block_size) <= p.num_blocks]
        if not fits_ever:
            largest = max(p.num_blocks * p.block_size for p in pools.values())
            raise AdmissionError(f"a request of up to {tokens} tokens needs more KV than any target replica has "
                                 f"({largest} token slots)")
        names = self._prefix_names(prefix, {pools[r].block_size for r in fits_ever})
        candidates, hits = [], {}
        for replica in fits_ever:
            pool = pools[replica]
            hits[replica] = pool.blocks.lookup(names[pool.block_size]) if pool.blocks.caching else []
            own_cached = sum(1 for b in hits[replica] if b not in pool.blocks.holders)  # shared, not taken
            candidates.append(Candidate(replica, len(hits[replica]), pool.blocks.available - own_cached,
                                        _ceil_div(tokens, pool.block_size) - len(hits[replica]), self._load[replica]))
        query = max((len(n) for n in names.values()), default=0)
        chosen = self.chooser.choose(candidates, query)
        if chosen is None:
            return None
        pool, shared = pools[chosen.replica], hits[chosen.replica]
        for block in shared:
            pool.blocks.share(block)
        blocks = shared + pool.blocks.take(chosen.needed)
        chain = names[pool.block_size][len(shared) - 1] if shared else ROOT_HASH
        self._seqs[seq_id] = _Grant(chosen.replica, blocks, len(shared), chain)
        self._load[chosen.replica] += 1
        return Grant(chosen.replica, list(blocks), len(shared), len(shared) * pool.block_size)

    @staticmethod
    def _prefix_names(prefix: Sequence[int], sizes: set[int]) -> dict[int, list[int]]:
        """Per block size, the names of the prefix's cacheable blocks."""
        return {size: block_hashes(prefix, size, count=cacheable_blocks(len(prefix), size)) for size in sizes}

    def try_admit_many(self, requests: Sequence[tuple], avoid: Sequence[str] = ()) -> list[Grant] | None:
        """``try_admit`` for several sequences that must run together (a request's
        choices), each ``(seq_id, tokens)`` or ``(seq_id, tokens, prefix)``: all of them
        reserved, each on the pool chosen then, or none (None: not now). Raises
        ``AdmissionError`` when one could never be held, or all of them could never be
        held at once."""
        pools = {r: p for r, p in self._pools.items() if r not in avoid}
        total = sum(p.num_blocks * p.block_size for p in pools.values())
        if pools and sum(request[1] for request in requests) > total:
            raise AdmissionError(f"{len(requests)} sequences of up to {[r[1] for r in requests]} tokens together "
                                 f"need more KV than the target replicas have ({total} token slots)")
        grants: list[Grant] = []
        try:
            for seq_id, tokens, *prefix in requests:
                grant = self.try_admit(seq_id, tokens, avoid, prefix[0] if prefix else ())
                if grant is None:
                    break
                grants.append(grant)
        finally:
            if len(grants) < len(requests):  # no room for all now (or an error): give back what this took
                for request in requests[: len(grants)]:
                    self.release(request[0])
        return grants if len(grants) == len(requests) else None

    def publish(self, seq_id: Hashable, tokens: Sequence[int]) -> int:
        """The sequence's target holds final KV for ``tokens`` (its first tokens) and has
        named their full blocks: name them here too, so later prompts share them.
        Returns how many of its leading blocks are named; 0 for a sequence not admitted
        (it may have been released already)."""
        entry = self._seqs.get(seq_id)
        pool = self._pools.get(entry.replica) if entry is not None else None
        if pool is None or not pool.blocks.caching:
            return 0
        full = min(len(tokens) // pool.block_size, len(entry.blocks))
        if full > entry.named:
            names = block_hashes(tokens, pool.block_size, entry.chain, entry.named, full - entry.named)
            for index, name in zip(range(entry.named, full), names):
                pool.blocks.name(entry.blocks[index], name)
            entry.named, entry.chain = full, names[-1]
        return entry.named

    def sequences(self) -> list[tuple[Hashable, str]]:
        """Every sequence holding a grant, with the replica it is on."""
        return [(seq_id, entry.replica) for seq_id, entry in self._seqs.items()]

    def release(self, seq_id: Hashable, tokens: Sequence[int] | None = None) -> bool:
        """The sequence is done and its target freed its pages; ``tokens``, where given,
        are its tokens whose KV was final there (``publish`` them first). Its named blocks
        stay cached, the rest are free."""
        if tokens:
            self.publish(seq_id, tokens)
        entry = self._seqs.pop(seq_id, None)
        if entry is None:
            return False
        pool = self._pools.get(entry.replica)
        if pool is not None:
            for block in entry.blocks:
                pool.blocks.drop(block)
            self._load[entry.replica] -= 1
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's ``/reset_prefix_cache``, for benchmarks):
        cached blocks become free, shared ones private to their holders. The targets keep
        their names, which nothing here shares again: their blocks are granted as free.
        Returns how many cached blocks were freed."""
        for entry in self._seqs.values():
            entry.named, entry.chain = len(entry.blocks), ROOT_HASH  # nothing of theirs is named again
        return sum(pool.blocks.reset() for pool in self._pools.values())

    def usage(self) -> dict:
        total = sum(p.num_blocks for p in self._pools.values())
        free = sum(p.blocks.available for p in self._pools.values())
        return {"replicas": len(self._pools), "total_blocks": total, "free_blocks": free,
                "reserved_blocks": total - free, "sequences": len(self._seqs),
                "cached_blocks": sum(p.blocks.cached for p in self._pools.values()),
                "per_replica": {r: {"sequences": self._load[r], "free_blocks": p.blocks.available,
                                    "cached_blocks": p.blocks.cached} for r, p in self._pools.items()}}
