"""Admission that waits for room: the block ledger behind an asyncio condition.

The in-process engine (``LocalTransport``) and the server's KV-manager actor both admit
through this one class, so a request that does not fit now waits for running requests
to finish -- up to ``timeout_s`` -- in both, and one that could never fit fails at once.
The ledger's prefix cache (``publish``, ``reset_prefix_cache``) goes through it too.
"""
from __future__ import annotations

import asyncio
import time
from typing import Hashable, Sequence

from specserve.engine.kv.block_ledger import AdmissionError, BlockLedger, Grant
from specserve.engine.kv.replica_choice import ReplicaRouting


class Admission:
    def __init__(self, timeout_s: float = 30.0, routing: ReplicaRouting = "prefix_aware") -> None:
        self.ledger = BlockLedger(routing)
        self.timeout_s = timeout_s
        self._room: asyncio.Condition | None = None  # made on first use, in the loop that uses it

    @property
    def room(self) -> asyncio.Condition:
        if self._room is None:
            self._room = asyncio.Condition()
        return self._room

    async def register_pool(self, replica: str, num_blocks: int, block_size: int,
                            live: dict[Hashable, list[int]] | None = None, names: dict[int, int] | None = None,
                            prefix_caching: bool = True) -> None:
        async with self.room:
            self.ledger.register_pool(replica, num_blocks, block_size, live, names, prefix_caching)
            self.room.notify_all()

    async def drop_pool(self, replica: str) -> list[Hashable]:
        async with self.room:
            lost = self.ledger.drop_pool(replica)
            self.room.notify_all()
            return lost

    async def admit(self, seq_id: Hashable, tokens: int, avoid: Sequence[str] = (),
                    prefix: Sequence[int] = ()) -> Grant:
        """Reserve KV for a request, waiting up to ``timeout_s`` for room; ``prefix``: the
        tokens its prefill feeds (``BlockLedger.try_admit`` shares their cached blocks)."""
        return await self._wait_for(lambda: self.ledger.try_admit(seq_id, tokens, avoid, prefix),
                                    f"up to {tokens} tokens")

    async def admit_many(self, requests: Sequence[tuple], avoid: Sequence[str] = ()) -> list[Grant]:
        """Reserve KV for several sequences that run together (a request's choices): all
        at once or none, waiting up to ``timeout_s`` for room for all of them -- so two
        such requests never each hold part of what they need while waiting for the rest."""
        return await self._wait_for(lambda: self.ledger.try_admit_many(requests, avoid),
                                    f"{len(requests)} sequences of up to {[r[1] for r in requests]} tokens")

    async def _wait_for(self, attempt, what: str):
        deadline = time.monotonic() + self.timeout_s
        async with self.room:
            while True:
                granted = attempt()
                if granted is not None:
                    return granted
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    usage = self.ledger.usage()
                    raise AdmissionError(
                        f"no KV room for a request of {what} after waiting {self.timeout_s:g} s "
                        f"({usage['free_blocks']} of {usage['total_blocks']} blocks free, {usage['sequences']} "
                        "sequences running); retry later")
                try:
                    await asyncio.wait_for(self.room.wait(), remaining)
                except asyncio.TimeoutError:
                    pass

    def publish(self, seq_id: Hashable, tokens: Sequence[int]) -> int:
        """Name a sequence's computed blocks (``BlockLedger.publish``); frees no room."""
        return self.ledger.publish(seq_id, tokens)

    async def release(self, seq_id: Hashable, tokens: Sequence[int] | None = None) -> bool:
        async with self.room:
            released = self.ledger.release(seq_id, tokens)
            if released:
                self.room.notify_all()
            return released

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (``BlockLedger.reset_prefix_cache``): a cached block
        was available already, so no waiter gains room."""
        return self.ledger.reset_prefix_cache()

    def usage(self) -> dict:
        return self.ledger.usage()
