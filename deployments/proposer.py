"""A proposer deployment: one model-based proposer kind (draft model, MTP, EAGLE-3 or
shared-KV) with its own replicas and resources. Each replica is a thin shell around its
worker actor (``workers.ProposerStepper``), where the kind's model runs, loaded through
the proposer registry as the in-process engine loads it.

Target hidden states and shared-KV slices arrive as ObjectRefs to the object the target
worker put in the store -- the router passes the references on without touching the
data. Sampled draft distributions go back the same way, as a reference.

How the router reaches the worker: a sequence's first round goes through Serve (which
picks a replica, power of two choices), and the reply names the replica's worker; later
rounds call that worker directly -- unless the deployment autoscales, whose replica
count Serve decides from the requests it sees: those keep every round on Serve's path.
"""
from __future__ import annotations

from typing import Hashable, Sequence

import ray
from ray import serve

from engine.sched.cost_tables import DraftCostTable
from engine.sched.proposer_worker import ProposeItem, ProposeResult
from engine.speculative.proposers.registry import PROPOSER_KINDS

from .affinity import TICK_WORKER_OPTIONS
from .settings import ServeSettings
from .workers import ProposerStepper, calls_go_direct, spawn_worker, worker_bundles


class ProposerModel:
    @classmethod
    def get_deployment_options(cls, settings: ServeSettings, mode: str) -> dict:
        """Serve options of ``mode``'s deployment (named by the registry); the builder
        layers ``deployment_overrides`` on top. The worker gets the replica's compute; a
        quarter of a GPU on CUDA: four proposer replicas share one device."""
        gpu = settings.engine.device == "cuda"
        bundles = worker_bundles(0.25, 0.25 if gpu else 0.0)
        return {
            "name": PROPOSER_KINDS[mode].deployment,
            "max_ongoing_requests": 2 * settings.engine.scheduler.lanes,
            "ray_actor_options": {"num_cpus": bundles[0]["CPU"]},
            "placement_group_bundles": bundles,
            **TICK_WORKER_OPTIONS,
        }

    def __init__(self, bundle_dir: str, mode: str, engine_config: dict) -> None:
        self.mode = mode
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.direct = calls_go_direct()
        self.worker = spawn_worker(ProposerStepper, bundle_dir, mode, engine_config)
        ray.get(self.worker.probe.remote())  # waits for the model to load and warm up
        self.serve_calls = 0  # propose calls that came through Serve rather than to the worker

    async def propose(self, items: Sequence[ProposeItem], releases: Sequence[Hashable],
                      replica_hint: str | None = None) -> tuple[str, list[ProposeResult], object]:
        """Draft through this replica's worker; the reply also carries the worker's handle
        (None when rounds must stay on Serve's path) for the router's next rounds."""
        self.serve_calls += 1
        served_by, results = await self.worker.propose.remote(self.replica_id, items, releases)
        return served_by, results, self.worker if self.direct else None

    async def draft_costs(self) -> DraftCostTable:
        """This replica's measured draft costs (``engine.sched.calibration``), measured at start-up."""
        return await self.worker.draft_costs.remote()

    async def transport_stats(self, replica_hint: str | None = None) -> dict:
        """This replica's counters (``replica_hint`` pins the call to one replica)."""
        return {"replica": self.replica_id, "serve_calls": self.serve_calls, **await self.worker.stats.remote()}

    def check_health(self) -> None:
        """Probe the real proposer model through the worker (``ProposerWorker.probe``)."""
        ray.get(self.worker.probe.remote(), timeout=30)
