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

Routers hold **leases**. A router names its sequences ``<owner>:<request>`` and renews
its owner's lease every second (``renew``, the call that also reads the KV gauges). An
owner not heard from for ``lease_s`` is dead -- killed, crashed, or cut off -- and the
reaper reclaims its sequences: each target worker frees their pages, then the ledger
frees their blocks, so a router's death never shrinks capacity for good. An owner this
manager has never heard from (it restarted, and the target replicas re-registered their
live grants) gets ``lease_s`` from the manager's start. Sequence ids without an owner
(the in-process engine's) are never reaped.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Hashable, Sequence

from specserve.engine.kv.admission import Admission
from specserve.engine.kv.block_ledger import Grant
from specserve.engine.kv.replica_choice import ReplicaRouting
from specserve.engine.sched.background import detached

log = logging.getLogger("specserve.kv_manager")

OWNER_SEPARATOR = ":"
# A router renews every second (Router._report_kv); 15 missed renewals is a dead router,
# not a busy one, and its blocks are back well within half a minute.
LEASE_S = 15.0
REAP_PERIOD_S = 2.0


def owned_seq_id(owner: str, request: str) -> str:
    return f"{owner}{OWNER_SEPARATOR}{request}"


def owner_of(seq_id: Hashable) -> str | None:
    if isinstance(seq_id, str) and OWNER_SEPARATOR in seq_id:
        return seq_id.split(OWNER_SEPARATOR, 1)[0]
    return None


class KVManager:
    def __init__(self, admission_timeout_s: float = 30.0, routing: ReplicaRouting = "prefix_aware",
                 lease_s: float = LEASE_S) -> None:
        self.admission = Admission(admission_timeout_s, routing)
        self.workers: dict[str, object] = {}  # replica -> the worker actor holding its pool
        self.draining: set[str] = set()  # replicas being stopped: no new admissions
        self.lease_s = lease_s
        self.started = time.monotonic()
        self.renewed: dict[str, float] = {}  # owner -> when its lease was last renewed
        self.reclaimed = 0  # sequences reclaimed from dead owners
        self._reaper: asyncio.Task | None = None

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
        self._heard_from([seq_id])
        return await self.admission.admit(seq_id, tokens, [*avoid, *self.draining], prefix)

    async def admit_many(self, requests: list[tuple], avoid: Sequence[str] = ()) -> list[Grant]:
        """Reserve KV for a request's choices: all at once or none (``Admission.admit_many``)."""
        self._heard_from([request[0] for request in requests])
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
        return {**self.admission.usage(), "draining": sorted(self.draining), "reclaimed": self.reclaimed}

    # -- leases --------------------------------------------------------------------------
    async def renew(self, owner: str) -> dict:
        """``owner`` is alive; returns ``usage()``."""
        self.renewed[owner] = time.monotonic()
        if self._reaper is None or self._reaper.done():
            self._reaper = detached(self._reap_forever())
        return await self.usage()

    def _heard_from(self, seq_ids: Sequence[Hashable]) -> None:
        """An admission renews its owner's lease: a router's first request never waits on
        its first renewal."""
        for owner in {owner_of(seq_id) for seq_id in seq_ids} - {None}:
            self.renewed[owner] = time.monotonic()

    def _expired(self, owner: str, now: float) -> bool:
        return now - self.renewed.get(owner, self.started) > self.lease_s

    async def reap(self) -> int:
        """Reclaim the sequences of every owner whose lease expired; returns how many."""
        now = time.monotonic()
        dead: dict[str, list[Hashable]] = {}
        for seq_id, replica in self.admission.ledger.sequences():
            owner = owner_of(seq_id)
            if owner is not None and self._expired(owner, now):
                dead.setdefault(replica, []).append(seq_id)
        for replica, seq_ids in dead.items():
            worker = self.workers.get(replica)
            if worker is not None:
                try:  # its pages first: the ledger may grant the blocks again at once
                    await worker.step.remote(replica, [], [], seq_ids)
                except Exception as exc:  # noqa: BLE001 - a dead replica's pages went with it
                    log.warning("target replica %s did not free reclaimed sequences: %s", replica, exc)
            for seq_id in seq_ids:
                await self.admission.release(seq_id)
        for owner in [o for o in self.renewed if self._expired(o, now)]:
            del self.renewed[owner]
        count = sum(len(ids) for ids in dead.values())
        if count:
            self.reclaimed += count
            log.warning("reclaimed %d sequences of routers whose lease expired (%s s)", count, self.lease_s)
        return count

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(REAP_PERIOD_S)
            try:
                await self.reap()
            except Exception:  # noqa: BLE001 - the next period tries again
                log.exception("reaping expired leases failed")
