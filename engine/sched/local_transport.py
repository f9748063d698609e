"""The coordinator's transport as plain function calls: target worker, proposer workers
and admission in this process. This is what the in-process ``Engine`` runs on; the Ray
Serve router runs the very same coordinator over ``deployments/transport.py``."""
from __future__ import annotations

from typing import Hashable, Sequence

from specserve.engine.errors import EngineError
from specserve.engine.kv.admission import Admission
from specserve.engine.kv.block_ledger import Grant
from specserve.engine.sched.cost_tables import DraftCostTable, VerifyCostTable
from specserve.engine.sched.messages import PrefillItem, ProposeItem, ProposeResult, TargetResult, VerifyItem
from specserve.engine.sched.proposer_worker import ProposerWorker
from specserve.engine.sched.target_worker import TargetWorker

LOCAL_REPLICA = "local"


class LocalTransport:
    concurrent = False  # every call runs to completion on the caller's thread: lanes could not overlap

    def __init__(self, target: TargetWorker, proposers: dict[str, ProposerWorker],
                 admission_timeout_s: float = 30.0) -> None:
        self.target, self.proposers = target, proposers
        self.admission = Admission(admission_timeout_s)
        cache = target.target.cache
        if cache.used_blocks:  # the ledger hands out ids of this very pool
            raise EngineError("the target pool must be empty when the ledger takes it over")
        self.admission.ledger.register_pool(LOCAL_REPLICA, cache.num_blocks, cache.block_size,
                                            names=cache.block_names(), prefix_caching=cache.prefix_caching)

    async def admit(self, seq_id: Hashable, tokens: int, avoid: Sequence[str], prefix: Sequence[int] = ()) -> Grant:
        # ``avoid`` names replicas that lost a sequence; the one local target never goes
        # away, so a sequence it lost is re-admitted right here (avoiding it would wait forever).
        return await self.admission.admit(seq_id, tokens, prefix=prefix)

    async def admit_many(self, requests: list[tuple[Hashable, int, Sequence[int]]]) -> list[Grant]:
        return await self.admission.admit_many(requests)

    async def publish(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        self.admission.publish(seq_id, tokens)

    async def release(self, seq_id: Hashable, tokens: Sequence[int] | None = None) -> None:
        await self.admission.release(seq_id, tokens)

    async def reset_prefix_cache(self) -> int:
        """Forget every cached prefix: the ledger's, the target's and each draft model's
        own (run on the coordinator's loop, between ticks)."""
        dropped = self.admission.reset_prefix_cache()
        self.target.target.cache.reset_prefix_cache()
        for worker in self.proposers.values():
            worker.reset_prefix_cache()
        return dropped

    async def target_step(self, replica: str, prefills: list[PrefillItem], verifies: list[VerifyItem],
                          releases: list[Hashable]) -> list[TargetResult]:
        return self.target.step(prefills, verifies, releases)

    async def propose(self, mode: str, replica: str | None, items: list[ProposeItem],
                      releases: list[Hashable]) -> tuple[str | None, list[ProposeResult]]:
        worker = self.proposers[mode]
        worker.release(releases)
        return LOCAL_REPLICA, worker.propose(items)

    async def forget_target(self, replica: str) -> None:
        return None  # the one local target never goes away

    async def verify_costs(self) -> VerifyCostTable:
        return self.target.verify_costs()

    async def draft_costs(self, mode: str) -> DraftCostTable:
        return self.proposers[mode].draft_costs()
