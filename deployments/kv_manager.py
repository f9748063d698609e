"""The KV-manager actor: the single authority for KV block allocation across target
replicas. It is a thin actor around ``engine.kv.admission.Admission`` -- the very
admission (block ledger + waiting for room) the in-process engine uses.

It is a Serve deployment-scoped actor of the target deployment: the Serve controller
creates it with the deployment, health-checks it, restarts it if it dies and removes
it with the deployment. Target replicas register their pools with it (and, after a
restart, their live grants) and the worker actor that serves each pool; routers admit
and release through it and learn there which worker to call for a replica's sequences.
It is never on a round's critical path: it is called once per request to admit, once
when its prefill is done (to share its prompt's blocks) and once to release (and once per
new replica to find its worker). It is also where a target replica's prefix cache is
looked up and prefix-aware routing happens (``engine.kv.block_ledger``). A replica that
Serve is stopping drains: its pool takes no new admissions while its sequences finish.
"""
from __future__ import annotations

import logging
from typing import Hashable, Sequence

from engine.kv.admission import Admission
from engine.kv.block_ledger import Grant
from engine.kv.replica_choice import ReplicaRouting

log = logging.getLogger("specserve.kv_manager")


class KVManager:
    def __init__(self, admission_timeout_s: float = 30.0, routing: ReplicaRouting = "prefix_aware") -> None:
        self.admission = Admission(admission_timeout_s, routing)
        self.workers: dict[str, object] = {}  # replica -> the worker actor holding its pool
        self.draining: set[str] = set()  # replicas being stopped: no new admissions

    async def register_pool(self, replica: str, num_blocks: int, block_size: int,
                            live: dict[Hashable, list[int]] | None = None, worker=None,
                            names: dict[int, int] | None = None, prefix_caching: bool = True) -> None:
        await self.admission.register_pool(replica, num_blocks, block_size, live, names, prefix_caching)
        if worker is not None:
            self.workers[replica] = worker
        log.info("target replica %s registered %d KV blocks of %d tokens (%d live sequences, %d named blocks, "
                 "prefix caching %s)", replica, num_blocks, block_size, len(live or {}), len(names or {}),
                 "on" if prefix_caching else "off")

    async def has_pool(self, replica: str) -> bool:
        return self.admission.ledger.has_pool(replica)

    async def drain_pool(self, replica: str) -> None:
        """Admit nothing more to this replica's pool (Serve is stopping it)."""
        self.draining.add(replica)
        log.info("target replica %s drains: no new admissions", replica)

    async def drop_pool(self, replica: str) -> list[Hashable]:
        self.workers.pop(replica, None)
        self.draining.discard(replica)
        return await self.admission.drop_pool(replica)

    async def worker(self, replica: str):
        """The worker actor of a replica's pool, or None if the replica is not registered."""
        return self.workers.get(replica)

    async def admit(self, seq_id: Hashable, tokens: int, avoid: Sequence[str] = (), prefix: Sequence[int] = ()
                    ) -> Grant:
        """Reserve KV for a request, waiting up to the admission timeout for room; its
        prefill's tokens (``prefix``) pick the replica and the cached blocks it shares."""
        return await self.admission.admit(seq_id, tokens, [*avoid, *self.draining], prefix)

    async def admit_many(self, requests: list[tuple], avoid: Sequence[str] = ()) -> list[Grant]:
        """Reserve KV for a request's choices: all at once or none (``Admission.admit_many``)."""
        return await self.admission.admit_many(requests, [*avoid, *self.draining])

    async def publish(self, seq_id: Hashable, tokens: Sequence[int]) -> int:
        """A prefill finished: its full blocks may be shared (``BlockLedger.publish``)."""
        return self.admission.publish(seq_id, tokens)

    async def release(self, seq_id: Hashable, tokens: Sequence[int] | None = None) -> bool:
        return await self.admission.release(seq_id, tokens)

    async def reset_prefix_cache(self) -> int:
        """Forget every cached prefix on every replica (``BlockLedger.reset_prefix_cache``)."""
        dropped = self.admission.reset_prefix_cache()
        log.info("prefix cache reset: %d cached blocks freed", dropped)
        return dropped

    async def usage(self) -> dict:
        return {**self.admission.usage(), "draining": sorted(self.draining)}
