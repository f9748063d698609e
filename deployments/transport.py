"""The coordinator's transport over Ray Serve: one deployment-handle call per replica
per tick, the KV manager by actor calls. Items are small; anchors and draft
distributions inside them are ObjectRefs, which Ray passes along unresolved."""
from __future__ import annotations

from typing import Callable, Hashable, Sequence

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle

from engine.block_ledger import Grant
from engine.coordinator import TargetUnavailableError
from engine.proposer_worker import ProposeItem, ProposeResult
from engine.target_worker import PrefillItem, TargetResult, VerifyItem

from .affinity import REPLICA_HINT

_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)


class ServeTransport:
    def __init__(self, target: DeploymentHandle, proposers: dict[str, DeploymentHandle],
                 kv_manager: Callable[[], object]) -> None:
        self.target, self.proposers, self._kv_manager = target, proposers, kv_manager

    async def admit(self, seq_id: Hashable, tokens: int, committed: Sequence[int], avoid: Sequence[str]) -> Grant:
        return await self._kv_manager().admit.remote(seq_id, tokens, list(committed), list(avoid))

    async def release(self, seq_id: Hashable) -> None:
        await self._kv_manager().release.remote(seq_id)

    async def target_step(self, replica: str, prefills: list[PrefillItem], verifies: list[VerifyItem],
                          releases: list[Hashable]) -> list[TargetResult]:
        try:
            # A different replica may serve the call if ours is gone: it answers
            # ``unknown_sequence`` and the coordinator re-prefills those sequences.
            _, results = await self.target.step.remote(prefills, verifies, releases, **{REPLICA_HINT: replica})
        except _GONE as exc:
            raise TargetUnavailableError(f"target replica {replica} is unavailable: {exc}") from exc
        return results

    async def propose(self, mode: str, replica: str | None, items: list[ProposeItem],
                      releases: list[Hashable]) -> tuple[str | None, list[ProposeResult]]:
        return await self.proposers[mode].propose.remote(items, releases, **{REPLICA_HINT: replica})
