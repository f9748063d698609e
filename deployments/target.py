"""The target-model deployment: a thin Serve replica around its worker actor
(``workers.TargetStepper``), which owns the target's ONNX session and the physical KV
pages of the sequences routed to it. The router calls the worker directly once per tick
(``ServeTransport.target_step``) -- through this replica only when the deployment
autoscales on Serve's request-count policy (``workers.calls_go_direct``); Serve keeps
this replica's lifecycle, health checks and autoscaling (the replica reports its worker's
load, ``record_autoscaling_stats``), and the replica keeps the KV manager's ledger of its
pool whole: it registers the pool when it starts, and when Serve stops it (downscaling,
a redeploy) it drains first (``__del__``)."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Hashable, Sequence

import ray
from ray import serve
from ray.serve.config import DeploymentActorConfig

from specserve.engine.sched.cost_tables import VerifyCostTable
from specserve.engine.sched.messages import PrefillItem, TargetResult, VerifyItem

from .affinity import TICK_WORKER_OPTIONS
from .kv_manager import KVManager
from .settings import ServeSettings
from .workers import TargetStepper, calls_go_direct, spawn_worker, worker_bundles

log = logging.getLogger("specserve.target")
KV_MANAGER = "kv_manager"
# CPUs of the target's worker on a CPU node: its batched calls run one onnxruntime thread
# per reserved CPU (``workers.worker_config``), and a batched decode step on two threads
# is what the in-process engine runs (docs/benchmarks/ measures one against two).
CPU_WORKER_CPUS = 2.0
# Calls a target worker holds at once: each router's tick call waits there to be merged
# with the others' (step_merging.py), beside the KV manager's and the health probes'.
TARGET_WORKER_CALLS = 32
DRAIN_MARGIN_S = 2.0  # of the graceful-shutdown budget, kept for dropping the pool after a drain


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
        bundles = worker_bundles(1.0, 1.0) if gpu else worker_bundles(CPU_WORKER_CPUS)
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
        self.worker = spawn_worker(TargetStepper, target_dir, engine_config, max_concurrency=TARGET_WORKER_CALLS)
        self.info = ray.get(self.worker.describe.remote())  # waits for the model to load and warm up
        self.health_probes = 0
        self.serve_steps = 0  # ticks that came through Serve rather than to the worker
        self.kv = None
        self._ensure_registered()

    async def __del__(self) -> None:
        """Serve stops this replica (downscaling, a redeploy): drain it. Its pool takes no
        new admissions, its sequences run on until they finish or the shutdown budget is
        nearly spent, and then its pool leaves the ledger. A sequence still running when
        the replica goes is re-admitted elsewhere and re-prefilled from its committed
        tokens (the router holds them), so a drain never loses or changes a token."""
        kv = getattr(self, "kv", None)
        if kv is None or getattr(self, "drained", False):
            return
        self.drained = True
        config = getattr(serve.get_replica_context(), "_deployment_config", None)
        budget = getattr(config, "graceful_shutdown_timeout_s", 20.0) - DRAIN_MARGIN_S
        try:
            await kv.drain_pool.remote(self.replica_id)
            deadline = time.monotonic() + budget
            while time.monotonic() < deadline and (await self.worker.load.remote())["sequences"]:
                await asyncio.sleep(0.2)
        except Exception as exc:  # noqa: BLE001 - the manager or our worker may be gone already
            log.warning("draining target replica %s: %r", self.replica_id, exc)
        try:
            await kv.drop_pool.remote(self.replica_id)
        except Exception:  # noqa: BLE001 - a restarted manager never heard of the pool
            pass

    def _ensure_registered(self) -> None:
        """Make sure the (current) KV manager knows this replica's pool and worker. After
        the manager was restarted it knows nothing: re-register with every live
        sequence's granted blocks and the pool's named (cached) blocks, so its ledger is
        whole again, no block is granted twice and cached prefixes stay shared. (Not once
        it drains: its pool is leaving.)"""
        if getattr(self, "drained", False):
            return
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

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's autoscaling hook: the load this replica really serves (``autoscaling``)."""
        return await self.worker.load.remote()

    async def kv_usage(self, replica_hint: str | None = None) -> dict:
        """This replica's pool and counters (``replica_hint`` pins the call to one replica)."""
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
