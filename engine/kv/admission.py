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
        deadline = time.monotonic() + self.timeout_s
        async with self.room:
            while True:
                grant = self.ledger.try_admit(seq_id, tokens, avoid)
                if grant is not None:
                    return grant
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    usage = self.ledger.usage()
                    raise AdmissionError(
                        f"no KV room for a request of up to {tokens} tokens after waiting {self.timeout_s:g} s "
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
