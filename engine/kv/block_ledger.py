"""The allocation truth for a distributed KV cache: which blocks of which target
replica's pool each sequence owns, and what it has committed.

Target replicas hold the physical pages; this ledger decides who gets which of them.
Admission reserves a sequence's worst case up front -- ``min(prompt + max_new_tokens,
context limit)`` tokens -- on the replica with the most free blocks. A round can then
never run out of KV, so the ledger is consulted once per request (admit, release) and
never on the per-round critical path; rounds report lengths and committed tokens to it
asynchronously (``record``). It keeps every sequence's committed tokens, so a lost
target replica costs a re-prefill, never output.
"""
from __future__ import annotations

from dataclasses import dataclass, field
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
class _Entry:
    replica: str
    blocks: list[int]
    kv_length: int = 0
    committed: list[int] = field(default_factory=list)


class BlockLedger:
    def __init__(self) -> None:
        self._pools: dict[str, _Pool] = {}
        self._seqs: dict[Hashable, _Entry] = {}

    # -- pools ---------------------------------------------------------------------------
    def register_pool(self, replica: str, num_blocks: int, block_size: int,
                      live: dict[Hashable, tuple[list[int], int, list[int]]] | None = None) -> None:
        """A target replica announces its pool. ``live`` -- sequence -> (granted blocks,
        KV length, committed tokens) -- restores what a replica already holds when the
        ledger itself was lost (a restarted KV manager), so no block is granted twice."""
        self.drop_pool(replica)
        live = live or {}
        used = {b for blocks, _, _ in live.values() for b in blocks}
        self._pools[replica] = _Pool(num_blocks, block_size, [b for b in range(num_blocks) if b not in used])
        for seq_id, (blocks, kv_length, committed) in live.items():
            self._seqs[seq_id] = _Entry(replica, list(blocks), kv_length, list(committed))

    def has_pool(self, replica: str) -> bool:
        return replica in self._pools

    def drop_pool(self, replica: str) -> list[Hashable]:
        """Forget a replica's pool (it died); returns the sequences that lived on it."""
        lost = [s for s, e in self._seqs.items() if e.replica == replica]
        for seq_id in lost:
            del self._seqs[seq_id]
        self._pools.pop(replica, None)
        return lost

    # -- sequences -----------------------------------------------------------------------
    def try_admit(self, seq_id: Hashable, tokens: int, committed: Sequence[int] = (),
                  avoid: Sequence[str] = ()) -> Grant | None:
        """Reserve blocks for ``tokens`` on the roomiest pool; None if none has room now.

        Raises ``AdmissionError`` when no pool could ever hold the request."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already admitted")
        pools = {r: p for r, p in self._pools.items() if r not in avoid}
        if not pools:
            return None  # no live target replica yet (starting, or being replaced): wait
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
        self._seqs[seq_id] = _Entry(replica, blocks, committed=list(committed))
        return Grant(replica, list(blocks))

    def record(self, updates: Sequence[tuple[Hashable, int, Sequence[int]]]) -> None:
        """Per-round reports: (sequence, KV length, tokens committed since the last report)."""
        for seq_id, kv_length, committed in updates:
            entry = self._seqs.get(seq_id)
            if entry is not None:  # a report may race a release; the release wins
                entry.kv_length = kv_length
                entry.committed.extend(committed)

    def release(self, seq_id: Hashable) -> bool:
        entry = self._seqs.pop(seq_id, None)
        if entry is None:
            return False
        pool = self._pools.get(entry.replica)
        if pool is not None:
            pool.free.extend(entry.blocks)
        return True

    def committed_tokens(self, seq_id: Hashable) -> list[int]:
        return list(self._seqs[seq_id].committed)

    def block_table(self, seq_id: Hashable) -> list[int]:
        """Blocks holding the sequence's KV now (a prefix of its grant)."""
        entry = self._seqs[seq_id]
        pool = self._pools[entry.replica]
        return entry.blocks[: -(-entry.kv_length // pool.block_size)]

    def usage(self) -> dict:
        total = sum(p.num_blocks for p in self._pools.values())
        free = sum(len(p.free) for p in self._pools.values())
        return {"replicas": len(self._pools), "total_blocks": total, "free_blocks": free,
                "reserved_blocks": total - free, "sequences": len(self._seqs),
                "blocks_holding_kv": sum(len(self.block_table(s)) for s in self._seqs)}
