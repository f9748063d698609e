"""Admission that waits for room: the block ledger behind an asyncio condition.

The in-process engine (``LocalTransport``) and the server's KV-manager actor both admit
through this one class, so a request that does not fit now waits for running requests
to finish -- up to ``timeout_s`` -- in both, and one that could never fit fails at once.
"""
from __future__ import annotations

import asyncio
import time
from typing import Hashable, Sequence

from engine.kv.block_ledger import AdmissionError, BlockLedger, Grant


class Admission:
    def __init__(self, timeout_s: float = 30.0) -> None:
        self.ledger = BlockLedger()
        self.timeout_s = timeout_s
        self._room: asyncio.Condition | None = None  # made on first use, in the loop that uses it

    @property
    def room(self) -> asyncio.Condition:
        if self._room is None:
            self._room = asyncio.Condition()
        return self._room

    async def register_pool(self, replica: str, num_blocks: int, block_size: int,
                            live: dict[Hashable, list[int]] | None = None) -> None:
        async with self.room:
            self.ledger.register_pool(replica, num_blocks, block_size, live)
            self.room.notify_all()

    async def drop_pool(self, replica: str) -> list[Hashable]:
        async with self.room:
            lost = self.ledger.drop_pool(replica)
            self.room.notify_all()
            return lost

    async def admit(self, seq_id: Hashable, tokens: int, avoid: Sequence[str] = ()) -> Grant:
        """Reserve KV for a request, waiting up to ``timeout_s`` for room."""
        return await self._wait_for(lambda: self.ledger.try_admit(seq_id, tokens, avoid), f"up to {tokens} tokens")

    async def admit_many(self, requests: Sequence[tuple[Hashable, int]], avoid: Sequence[str] = ()) -> list[Grant]:
        """Reserve KV for several sequences that run together (a request's choices): all
        at once or none, waiting up to ``timeout_s`` for room for all of them -- so two
        such requests never each hold part of what they need while waiting for the rest."""
        return await self._wait_for(lambda: self.ledger.try_admit_many(requests, avoid),
                                    f"{len(requests)} sequences of up to {[t for _, t in requests]} tokens")

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

    async def release(self, seq_id: Hashable) -> bool:
        async with self.room:
            released = self.ledger.release(seq_id)
            if released:
                self.room.notify_all()
            return released

    def usage(self) -> dict:
        return self.ledger.usage()
