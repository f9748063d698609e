"""The coordinator's transport as plain function calls: target, proposers and block
ledger in this process. It runs the exact round algorithm of the distributed server
without Ray, which is how the split algorithm is tested on its own and benchmarked
against the Ray transport."""
from __future__ import annotations

from typing import Hashable, Sequence

from engine.kv.block_ledger import AdmissionError, BlockLedger, Grant
from engine.errors import EngineError
from engine.sched.proposer_worker import ProposeItem, ProposeResult, ProposerWorker
from engine.sched.target_worker import PrefillItem, TargetResult, TargetWorker, VerifyItem

LOCAL_REPLICA = "local"


class LocalTransport:
    def __init__(self, target: TargetWorker, proposers: dict[str, ProposerWorker]) -> None:
        self.target, self.proposers = target, proposers
        self.ledger = BlockLedger()
        cache = target.target.cache
        self.ledger.register_pool(LOCAL_REPLICA, cache.num_blocks, cache.block_size)
        if cache.used_blocks:  # the ledger hands out ids of this very pool
            raise EngineError("the target pool must be empty when the ledger takes it over")

    async def admit(self, seq_id: Hashable, tokens: int, committed: Sequence[int], avoid: Sequence[str]) -> Grant:
        grant = self.ledger.try_admit(seq_id, tokens, committed, ())
        if grant is None:
            raise AdmissionError(f"no KV room now for {tokens} tokens")
        return grant

    async def release(self, seq_id: Hashable) -> None:
        self.ledger.release(seq_id)

    async def target_step(self, replica: str, prefills: list[PrefillItem], verifies: list[VerifyItem],
                          releases: list[Hashable]) -> list[TargetResult]:
        results = self.target.step(prefills, verifies, releases)
        self.ledger.record([(r.seq_id, r.kv_length, r.outcome.tokens) for r in results if r.outcome is not None])
        return results

    async def propose(self, mode: str, replica: str | None, items: list[ProposeItem],
                      releases: list[Hashable]) -> tuple[str | None, list[ProposeResult]]:
        worker = self.proposers[mode]
        worker.release(releases)
        return LOCAL_REPLICA, worker.propose(items)

    async def forget_target(self, replica: str) -> None:
        return None  # the one local target never goes away
