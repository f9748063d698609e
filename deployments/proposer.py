"""A proposer deployment: one model-based proposer mode (draft model, MTP, EAGLE-3 or
shared-KV) with its own replicas and resources. Each replica is a thin shell around its
worker actor (``workers.ProposerStepper``), where the mode's model runs, loaded through
the proposer registry as the in-process engine loads it.

Target hidden states and shared-KV slices arrive as ObjectRefs to the object the target
worker put in the store -- the router passes the references on without touching the
data. Sampled draft distributions go back the same way, as a reference.

How the router reaches the worker: a sequence's first round goes through Serve (which
picks a replica, power of two choices, and never one that is stopping), and the reply
names the replica's worker; later rounds call that worker directly -- unless the
deployment autoscales on Serve's request-count policy (``workers.calls_go_direct``),
which keeps every round on Serve's path. The replica reports its worker's load to Serve's
autoscaler (``record_autoscaling_stats``), and when Serve stops it, it waits for its
sequences to finish first (``__del__``).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Hashable, Sequence

import ray
from ray import serve

from specserve.engine.sched.cost_tables import DraftCostTable
from specserve.engine.sched.messages import ProposeItem, ProposeResult
from specserve.engine.speculative.proposers.registry import PROPOSER_MODES

from .affinity import TICK_WORKER_OPTIONS
from .settings import ServeSettings
from .workers import ProposerStepper, calls_go_direct, spawn_worker, worker_bundles

log = logging.getLogger("specserve.proposer")
DRAIN_MARGIN_S = 2.0  # of the graceful-shutdown budget, left when a drain gives up waiting


class ProposerModel:
    @classmethod
    def get_deployment_options(cls, settings: ServeSettings, mode: str) -> dict:
        """Serve options of ``mode``'s deployment (named by the registry); the builder
        layers ``deployment_overrides`` on top. The worker gets the replica's compute; a
        quarter of a GPU on CUDA: four proposer replicas share one device."""
        gpu = settings.engine.device == "cuda"
        bundles = worker_bundles(0.25, 0.25 if gpu else 0.0)
        return {
            "name": PROPOSER_MODES[mode].deployment,
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

    async def __del__(self) -> None:
        """Serve stops this replica: Serve routes no new sequence here any more; wait
        (within the shutdown budget) for the ones it drafts for to finish. A sequence still
        here when it goes re-syncs with another replica, one round without drafts."""
        worker = getattr(self, "worker", None)
        if worker is None or getattr(self, "drained", False):
            return
        self.drained = True
        config = getattr(serve.get_replica_context(), "_deployment_config", None)
        deadline = time.monotonic() + getattr(config, "graceful_shutdown_timeout_s", 20.0) - DRAIN_MARGIN_S
        try:
            while time.monotonic() < deadline and (await worker.load.remote())["sequences"]:
                await asyncio.sleep(0.2)
        except Exception as exc:  # noqa: BLE001 - the worker may be gone already
            log.warning("draining %s replica %s: %r", self.mode, self.replica_id, exc)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's autoscaling hook: the load this replica really serves (``autoscaling``)."""
        return await self.worker.load.remote()

    async def draft_costs(self) -> DraftCostTable:
        """This replica's measured draft costs (``engine.sched.calibration``), measured at start-up."""
        return await self.worker.draft_costs.remote()

    async def transport_stats(self, replica_hint: str | None = None) -> dict:
        """This replica's counters (``replica_hint`` pins the call to one replica)."""
        return {"replica": self.replica_id, "serve_calls": self.serve_calls, **await self.worker.stats.remote()}

    def check_health(self) -> None:
        """Probe the real proposer model through the worker (``ProposerWorker.probe``)."""
        ray.get(self.worker.probe.remote(), timeout=30)
