"""Request routing that keeps a sequence on the replica holding its state.

A target replica holds a sequence's KV pages and a proposer replica its draft state, so
a call made for a batch of sequences must reach *that* replica. Callers name it in a
``replica_hint`` keyword argument; this router sends the call there while the replica
is alive, and otherwise falls back to Serve's default power-of-two-choices -- the
replica that gets the call then reports the sequences it does not know, and the
coordinator re-prefills them (nothing committed is lost).
"""
from __future__ import annotations

from typing import List, Optional

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RunningReplica

REPLICA_HINT = "replica_hint"


class ReplicaAffinityRouter(PowerOfTwoChoicesRequestRouter):
    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        hint = pending_request.kwargs.get(REPLICA_HINT) if pending_request is not None else None
        if hint:
            pinned = [r for r in candidate_replicas if r.replica_id.unique_id == hint]
            if pinned:
                return [pinned]
        return await super().choose_replicas(candidate_replicas, pending_request)


# After the class: the config imports it by name.
AFFINITY_ROUTER = RequestRouterConfig(request_router_class="specserve.deployments.affinity:ReplicaAffinityRouter")
# Serve options shared by the deployments the coordinator calls every tick (the target and
# the proposers): affinity routing, a health probe of the real model every 10 s, and no
# access log (per-tick calls would log several lines per round).
TICK_WORKER_OPTIONS = {"request_router_config": AFFINITY_ROUTER, "health_check_period_s": 10,
                       "logging_config": {"enable_access_log": False}}
