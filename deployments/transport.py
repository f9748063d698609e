"""The coordinator's transport over Ray: one call per replica per tick, made straight to
the replica's worker actor (``workers.py``) -- a plain actor call, a fraction of what a
Serve handle call costs (docs/architecture.md). Serve handles are used to discover workers (a
sequence's first proposer round, ``describe``), for calls a deployment's autoscaler must
see, and never per round for the target. The KV manager is called by actor calls, and
says which worker holds a target replica's pool. Items are small; anchors and draft
distributions inside them are ObjectRefs, which Ray passes along unresolved."""
from __future__ import annotations

import asyncio
import functools
import logging
from collections import Counter
from typing import Hashable, Sequence

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle

from specserve.engine.kv.block_ledger import AdmissionError, Grant
from specserve.engine.sched.background import detached
from specserve.engine.sched.coordinator import TargetUnavailableError
from specserve.engine.sched.cost_tables import DraftCostTable, VerifyCostTable
from specserve.engine.sched.messages import PrefillItem, ProposeItem, ProposeResult, TargetResult, VerifyItem

from .affinity import REPLICA_HINT

_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)
log = logging.getLogger("specserve.transport")


class ServeTransport:
    concurrent = True  # calls to replicas overlap: several lanes hide one lane's proposing behind another's verify

    def __init__(self, target: DeploymentHandle, proposers: dict[str, DeploymentHandle], kv_manager,
                 target_workers: dict[str, object] | None = None) -> None:
        self.target, self.proposers, self.kv_manager = target, proposers, kv_manager
        self.target_workers: dict[str, object] = dict(target_workers or {})  # replica -> worker actor
        self.proposer_workers: dict[tuple[str, str], object] = {}  # (mode, replica) -> worker actor
        # (mode, proposer replica) -> sequence-rounds it drafted for: which replicas really serve
        self.drafted_by: Counter[tuple[str, str]] = Counter()
        self.verified_by: Counter[str] = Counter()  # target replica -> sequence-rounds it verified

    async def kv_call(self, method: str, *args):
        """Call the KV manager; if it died, fetch the restarted one (a target replica
        re-registers its pool and live sequences with it first) and try once more."""
        try:
            return await getattr(self.kv_manager, method).remote(*args)
        except _GONE:
            log.warning("KV manager unavailable; fetching the restarted one")
            self.kv_manager = (await self.target.describe.remote())["kv_manager"]
            return await getattr(self.kv_manager, method).remote(*args)

    async def admit(self, seq_id: Hashable, tokens: int, avoid: Sequence[str], prefix: Sequence[int] = ()) -> Grant:
        """Reserve KV on the KV manager. Cancelling an await of a Ray actor task does not
        cancel the task (checked here: an async actor method awaited and cancelled runs to
        its end), so a grant could land after its caller left, when the release sent on
        leaving had found nothing to release: such a grant is released when it lands."""
        return await self._admission(self.kv_call("admit", seq_id, tokens, list(avoid), list(prefix)), [seq_id])

    async def admit_many(self, requests: list[tuple[Hashable, int, Sequence[int]]]) -> list[Grant]:
        """A request's choices, all at once or none (``KVManager.admit_many``)."""
        requests = [(seq_id, tokens, list(prefix)) for seq_id, tokens, prefix in requests]
        return await self._admission(self.kv_call("admit_many", requests), [r[0] for r in requests])

    async def _admission(self, coroutine, seq_ids: list[Hashable]):
        call = detached(coroutine)
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(functools.partial(self._release_if_granted, seq_ids))
            raise
        except _GONE as exc:
            raise AdmissionError(f"the KV manager is restarting; retry shortly ({type(exc).__name__})") from exc

    def _release_if_granted(self, seq_ids: list[Hashable], call: asyncio.Future) -> None:
        if not call.cancelled() and call.exception() is None:
            for seq_id in seq_ids:
                detached(self.release(seq_id))

    async def publish(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        await self.kv_call("publish", seq_id, list(tokens))

    async def release(self, seq_id: Hashable, tokens: Sequence[int] | None = None) -> None:
        await self.kv_call("release", seq_id, None if tokens is None else list(tokens))

    async def reset_prefix_cache(self) -> int:
        return await self.kv_call("reset_prefix_cache")

    async def forget_target(self, replica: str) -> None:
        self.target_workers.pop(replica, None)
        await self.kv_call("drop_pool", replica)

    async def verify_costs(self) -> VerifyCostTable:
        """A target replica's measured verify costs (asked once per router: replicas of one
        deployment run the same model on the same kind of node)."""
        return await self.target.verify_costs.remote()

    async def draft_costs(self, mode: str) -> DraftCostTable:
        """A proposer replica's measured draft costs (asked once per mode per router)."""
        return await self.proposers[mode].draft_costs.remote()

    async def _target_worker(self, replica: str):
        """The replica's worker, or None where its rounds go through Serve (asked once)."""
        if replica not in self.target_workers:
            self.target_workers[replica] = await self.kv_call("worker", replica)
        return self.target_workers[replica]

    async def target_step(self, replica: str, prefills: list[PrefillItem], verifies: list[VerifyItem],
                          releases: list[Hashable]) -> list[TargetResult]:
        worker = await self._target_worker(replica)
        try:
            if worker is not None:
                served_by, results = await worker.step.remote(replica, prefills, verifies, releases)
            else:  # if ours is gone, another replica gets the call (affinity.py) and refuses it
                served_by, results = await self.target.step.remote(prefills, verifies, releases,
                                                                   **{REPLICA_HINT: replica})
        except _GONE as exc:
            self.target_workers.pop(replica, None)
            raise TargetUnavailableError(f"target replica {replica} is unavailable: {exc}") from exc
        if served_by != replica:
            self.target_workers.pop(replica, None)
            raise TargetUnavailableError(f"target replica {replica} is gone (call reached {served_by})")
        self.verified_by[replica] += len(verifies)
        return results

    async def propose(self, mode: str, replica: str | None, items: list[ProposeItem],
                      releases: list[Hashable]) -> tuple[str | None, list[ProposeResult]]:
        worker = self.proposer_workers.get((mode, replica)) if replica is not None else None
        if worker is not None:
            try:
                served_by, results = await worker.propose.remote(replica, items, releases)
            except _GONE:
                self.proposer_workers.pop((mode, replica), None)
                raise
        else:
            served_by, results, worker = await self.proposers[mode].propose.remote(items, releases,
                                                                                   **{REPLICA_HINT: replica})
            if worker is not None:
                self.proposer_workers[(mode, served_by)] = worker
        drafted = sum(1 for r in results if r.tokens)
        if drafted:
            self.drafted_by[(mode, served_by)] += drafted
        return served_by, results

    def target_replicas(self) -> dict[str, int]:
        """Target replica -> sequence-rounds it verified."""
        return dict(self.verified_by)

    def proposer_replicas(self) -> dict[str, dict[str, int]]:
        """mode -> proposer replica -> sequence-rounds it returned drafts for."""
        out: dict[str, dict[str, int]] = {}
        for (mode, replica), rounds in self.drafted_by.items():
            out.setdefault(mode, {})[replica] = rounds
        return out
