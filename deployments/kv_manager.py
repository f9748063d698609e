"""The KV-manager actor: the single authority for KV block allocation across target
replicas (``engine.kv.block_ledger``), with admission that waits for room.

It is a Serve deployment-scoped actor of the target deployment: the Serve controller
creates it with the deployment, health-checks it, restarts it if it dies and removes
it with the deployment. Target replicas register their pools with it; routers admit
and release through it. It is never on a round's critical path: admission happens once
per request, and rounds report to it asynchronously.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Hashable, Sequence

from engine.kv.block_ledger import AdmissionError, BlockLedger, Grant

log = logging.getLogger("specserve.kv_manager")


class KVManager:
    def __init__(self, admission_timeout_s: float = 30.0) -> None:
        self.ledger = BlockLedger()
        self.admission_timeout_s = admission_timeout_s
        self._room = asyncio.Condition()

    async def register_pool(self, replica: str, num_blocks: int, block_size: int, live: dict | None = None) -> None:
        async with self._room:
            self.ledger.register_pool(replica, num_blocks, block_size, live)
            self._room.notify_all()
        log.info("target replica %s registered %d KV blocks of %d tokens (%d live sequences)", replica, num_blocks,
                 block_size, len(live or {}))

    async def has_pool(self, replica: str) -> bool:
        return self.ledger.has_pool(replica)

    async def drop_pool(self, replica: str) -> list[Hashable]:
        async with self._room:
            lost = self.ledger.drop_pool(replica)
            self._room.notify_all()
            return lost

    async def admit(self, seq_id: Hashable, tokens: int, committed: Sequence[int] = (),
                    avoid: Sequence[str] = ()) -> Grant:
        """Reserve KV for a request, waiting up to the admission timeout for room."""
        deadline = time.monotonic() + self.admission_timeout_s
        async with self._room:
            while True:
                grant = self.ledger.try_admit(seq_id, tokens, committed, avoid)
                if grant is not None:
                    return grant
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    usage = self.ledger.usage()
                    raise AdmissionError(
                        f"no KV room for a request of up to {tokens} tokens after waiting "
                        f"{self.admission_timeout_s:g} s ({usage['free_blocks']} of {usage['total_blocks']} blocks "
                        f"free, {usage['sequences']} sequences running); retry later")
                try:
                    await asyncio.wait_for(self._room.wait(), remaining)
                except asyncio.TimeoutError:
                    pass

    async def record(self, updates: Sequence[tuple[Hashable, int, Sequence[int]]]) -> None:
        self.ledger.record(updates)

    async def release(self, seq_id: Hashable) -> bool:
        async with self._room:
            released = self.ledger.release(seq_id)
            if released:
                self._room.notify_all()
            return released

    async def committed_tokens(self, seq_id: Hashable) -> list[int]:
        return self.ledger.committed_tokens(seq_id)

    async def usage(self) -> dict:
        return self.ledger.usage()
