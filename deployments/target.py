"""The target-model deployment: a thin Serve replica around its worker actor
(``workers.TargetStepper``), which owns the target's ONNX session and the physical KV
pages of the sequences routed to it. The router calls the worker directly once per tick
(``ServeTransport.target_step``) -- through this replica only when the deployment
autoscales (``workers.calls_go_direct``); Serve keeps this replica's lifecycle and health
checks, and the replica keeps the KV manager's ledger of its pool whole."""
from __future__ import annotations

import logging
import time
from typing import Hashable, Sequence

import ray
from ray import serve
from ray.serve.config import DeploymentActorConfig

from engine.sched.cost_tables import VerifyCostTable
from engine.sched.target_worker import PrefillItem, TargetResult, VerifyItem

from .affinity import TICK_WORKER_OPTIONS
from .kv_manager import KVManager
from .settings import ServeSettings
from .workers import TargetStepper, calls_go_direct, spawn_worker, worker_bundles

log = logging.getLogger("specserve.target")
KV_MANAGER = "kv_manager"


def kv_manager_handle(attempts: int = 100):
    """The deployment-scoped KV manager (it may still be starting, or restarting)."""
    for attempt in range(attempts):
        try:
            return serve.get_deployment_actor(KV_MANAGER)
        except ValueError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.1)


class TargetModel:
    @classmethod
    def get_deployment_options(cls, settings: ServeSettings) -> dict:
        """This deployment's Serve options (the builder layers ``deployment_overrides`` on
        top): the replica shell and its worker in one placement group (the worker holds
        the compute), affinity routing for calls that name a replica, and the KV
        manager as a deployment-scoped actor."""
        gpu = settings.engine.device == "cuda"
        bundles = worker_bundles(0.5, 1.0 if gpu else 0.0)
        return {
            "name": "TargetModel",
            "max_ongoing_requests": 2 * settings.engine.scheduler.lanes,
            "ray_actor_options": {"num_cpus": bundles[0]["CPU"]},
            "placement_group_bundles": bundles,
            **TICK_WORKER_OPTIONS,
            "deployment_actors": [DeploymentActorConfig(
                name=KV_MANAGER, actor_class=ray.remote(KVManager),
                init_kwargs={"admission_timeout_s": settings.engine.scheduler.admission_timeout_s,
                             "routing": settings.engine.scheduler.replica_routing},
                actor_options={"num_cpus": 0.05})],
        }

    def __init__(self, target_dir: str, engine_config: dict) -> None:
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.direct = calls_go_direct()
        self.worker = spawn_worker(TargetStepper, target_dir, engine_config)
        self.info = ray.get(self.worker.describe.remote())  # waits for the model to load and warm up
        self.health_probes = 0
        self.serve_steps = 0  # ticks that came through Serve rather than to the worker
        self.kv = None
        self._ensure_registered()

    def __del__(self) -> None:
        """A replica that shuts down (downscaling, redeploy) takes its pool out of the ledger."""
        kv = getattr(self, "kv", None)
        if kv is not None:
            try:
                kv.drop_pool.remote(self.replica_id)
            except Exception:  # noqa: BLE001 - the manager may be gone already
                pass

    def _ensure_registered(self) -> None:
        """Make sure the (current) KV manager knows this replica's pool and worker. After
        the manager was restarted it knows nothing: re-register with every live
        sequence's granted blocks and the pool's named (cached) blocks, so its ledger is
        whole again, no block is granted twice and cached prefixes stay shared."""
        kv = kv_manager_handle()
        if ray.get(kv.has_pool.remote(self.replica_id), timeout=10):
            self.kv = kv
            return
        live, names = ray.get(self.worker.pool_state.remote(), timeout=30)
        ray.get(kv.register_pool.remote(self.replica_id, self.info["num_blocks"], self.info["block_size"], live,
                                        self.worker if self.direct else None, names, self.info["prefix_caching"]),
                timeout=10)
        self.kv = kv

    def describe(self) -> dict:
        """What a router needs to know once: limits, EOS, outputs, and who allocates KV."""
        self._ensure_registered()
        return {"replica": self.replica_id, **self.info, "kv_manager": self.kv,
                "worker": self.worker if self.direct else None}

    async def step(self, prefills: Sequence[PrefillItem], verifies: Sequence[VerifyItem],
                   releases: Sequence[Hashable], replica_hint: str | None = None) -> tuple[str, list[TargetResult]]:
        """A tick through Serve, for an autoscaled deployment (``calls_go_direct``). A call
        meant for another replica (routed here because that one is gone) is refused
        untouched: its KV blocks were granted in the other replica's pool."""
        if replica_hint is not None and replica_hint != self.replica_id:
            return self.replica_id, []
        self.serve_steps += 1
        return await self.worker.step.remote(self.replica_id, prefills, verifies, releases)

    async def verify_costs(self) -> VerifyCostTable:
        """This replica's measured verify costs (``engine.sched.calibration``), for the router's
        adaptive speculation; measured once at start-up."""
        return await self.worker.verify_costs.remote()

    async def kv_usage(self) -> dict:
        return {"replica": self.replica_id, **await self.worker.usage.remote(), "health_probes": self.health_probes,
                "serve_steps": self.serve_steps}

    def check_health(self) -> None:
        """Probe the real ONNX session through the worker (``TargetWorker.probe``), so a
        stalled, broken or dead worker fails Serve's health check and the replica is
        replaced; and re-register with a KV manager that was restarted."""
        try:
            self._ensure_registered()
        except ray.exceptions.RayActorError:
            raise  # our worker is gone: this replica is no use
        except Exception as exc:  # noqa: BLE001 - the manager being away is not this replica's fault
            log.warning("KV manager not reachable yet (%s); will re-register on the next check", exc)
        self.health_probes += 1
        ray.get(self.worker.probe.remote(), timeout=30)
