"""The allocation truth for the KV cache: which blocks of which target pool each
sequence owns.

Target workers hold the physical pages; this ledger decides who gets which of them.
Admission reserves a sequence's worst case up front (``kv_reservation``) on the pool
with the most free blocks, so a round can never run out of KV and the ledger is
consulted once per request (admit, release) -- never on a round's critical path.

Recovery does not need the ledger to know committed tokens: the coordinator holds
every request's committed tokens (it streams them), so a lost target pool costs a
re-prefill from those, and a lost ledger is rebuilt from the pools' live grants
(``register_pool(..., live=...)``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

from engine.kv.paged_cache import KVCacheCapacityError


class AdmissionError(KVCacheCapacityError):
    """The request cannot be given KV blocks (now, or ever)."""


@dataclass(frozen=True)
class Grant:
    replica: str
    blocks: list[int]


@dataclass
class _Pool:
    num_blocks: int
    block_size: int
    free: list[int]


@dataclass
class _Grant:
    replica: str
    blocks: list[int]


class BlockLedger:
    def __init__(self) -> None:
        self._pools: dict[str, _Pool] = {}
        self._seqs: dict[Hashable, _Grant] = {}

    # -- pools ---------------------------------------------------------------------------
    def register_pool(self, replica: str, num_blocks: int, block_size: int,
                      live: dict[Hashable, list[int]] | None = None) -> None:
        """A target pool announces itself. ``live`` -- sequence -> granted blocks --
        restores what a pool already holds when the ledger itself was lost (a restarted
        KV manager), so no block is granted twice."""
        self.drop_pool(replica)
        live = live or {}
        used = {b for blocks in live.values() for b in blocks}
        self._pools[replica] = _Pool(num_blocks, block_size, [b for b in range(num_blocks) if b not in used])
        for seq_id, blocks in live.items():
            self._seqs[seq_id] = _Grant(replica, list(blocks))

    def has_pool(self, replica: str) -> bool:
        return replica in self._pools

    def drop_pool(self, replica: str) -> list[Hashable]:
        """Forget a pool (its replica died); returns the sequences that lived on it."""
        lost = [s for s, e in self._seqs.items() if e.replica == replica]
        for seq_id in lost:
            del self._seqs[seq_id]
        self._pools.pop(replica, None)
        return lost

    # -- sequences -----------------------------------------------------------------------
    def try_admit(self, seq_id: Hashable, tokens: int, avoid: Sequence[str] = ()) -> Grant | None:
        """Reserve blocks for ``tokens`` on the roomiest pool; None if none has room now.

        Raises ``AdmissionError`` when no pool could ever hold the request."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already admitted")
        pools = {r: p for r, p in self._pools.items() if r not in avoid}
        if not pools:
            return None  # no live target pool yet (starting, or being replaced): wait
        fits_ever = [r for r, p in pools.items() if -(-tokens // p.block_size) <= p.num_blocks]
        if not fits_ever:
            largest = max(p.num_blocks * p.block_size for p in pools.values())
            raise AdmissionError(f"a request of up to {tokens} tokens needs more KV than any target replica has "
                                 f"({largest} token slots)")
        replica = max(fits_ever, key=lambda r: len(pools[r].free))
        pool = pools[replica]
        needed = -(-tokens // pool.block_size)
        if needed > len(pool.free):
            return None
        blocks, pool.free = pool.free[:needed], pool.free[needed:]
        self._seqs[seq_id] = _Grant(replica, blocks)
        return Grant(replica, list(blocks))

    def try_admit_many(self, requests: Sequence[tuple[Hashable, int]], avoid: Sequence[str] = ()
                       ) -> list[Grant] | None:
        """``try_admit`` for several sequences that must run together (a request's
        choices): all of them reserved, each on the roomiest pool then, or none (None:
        not now). Raises ``AdmissionError`` when one could never be held, or all of them
        could never be held at once."""
        pools = {r: p for r, p in self._pools.items() if r not in avoid}
        total = sum(p.num_blocks * p.block_size for p in pools.values())
        if pools and sum(tokens for _, tokens in requests) > total:
            raise AdmissionError(f"{len(requests)} sequences of up to {[t for _, t in requests]} tokens together need "
                                 f"more KV than the target replicas have ({total} token slots)")
        grants: list[Grant] = []
        try:
            for seq_id, tokens in requests:
                grant = self.try_admit(seq_id, tokens, avoid)
                if grant is None:
                    break
                grants.append(grant)
        finally:
            if len(grants) < len(requests):  # no room for all now (or an error): give back what this took
                for seq_id, _ in requests[: len(grants)]:
                    self.release(seq_id)
        return grants if len(grants) == len(requests) else None

    def release(self, seq_id: Hashable) -> bool:
        entry = self._seqs.pop(seq_id, None)
        if entry is None:
            return False
        pool = self._pools.get(entry.replica)
        if pool is not None:
            pool.free.extend(entry.blocks)
        return True

    def usage(self) -> dict:
        total = sum(p.num_blocks for p in self._pools.values())
        free = sum(len(p.free) for p in self._pools.values())
        return {"replicas": len(self._pools), "total_blocks": total, "free_blocks": free,
                "reserved_blocks": total - free, "sequences": len(self._seqs)}
