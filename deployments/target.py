"""The target-model deployment: owns the target's ONNX session and the physical KV
pages of the sequences routed to it, and runs their prefills and batched verifies
(``engine.sched.target_worker``). Per sequence it returns O(k) data -- accepted count,
tokens, logprobs -- and puts the hidden-state anchors (and shared-KV slices) of the
whole call into the object store as one object, returning only its ObjectRef."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Hashable, Sequence

import ray
from ray import serve
from ray.serve.config import DeploymentActorConfig

from engine.config import EngineConfig
from engine.model.cached_decoder import CachedDecoder
from engine.sched.costs import VerifyCostTable
from engine.sched.target_worker import PrefillItem, TargetResult, TargetWorker, VerifyItem

from .affinity import TICK_WORKER_OPTIONS
from .kv_manager import KVManager
from .settings import ServeSettings

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
        top): one call per lane per tick in flight, affinity routing (a sequence's KV
        lives on one replica), and the KV manager as a deployment-scoped actor."""
        gpu = settings.engine.device == "cuda"
        return {
            "name": "TargetModel",
            "max_ongoing_requests": 2 * settings.engine.scheduler.lanes,
            "ray_actor_options": {"num_cpus": 0.5, **({"num_gpus": 1} if gpu else {})},
            **TICK_WORKER_OPTIONS,
            "deployment_actors": [DeploymentActorConfig(
                name=KV_MANAGER, actor_class=ray.remote(KVManager),
                init_kwargs={"admission_timeout_s": settings.engine.scheduler.admission_timeout_s},
                actor_options={"num_cpus": 0.05})],
        }

    def __init__(self, target_dir: str, engine_config: dict) -> None:
        self.config = EngineConfig.model_validate(engine_config)
        # One replica among several on the node: its threads must not spin on shared cores.
        self.decoder = CachedDecoder(Path(target_dir), self.config, owns_cores=False)
        self.worker = TargetWorker(self.decoder)
        # Time verify passes before taking sequences (adaptive speculation plans with them;
        # it also warms onnxruntime up, so the first request does not pay for it).
        self.worker.verify_costs(self.config.scheduler.max_batch_size)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._lock = threading.Lock()  # one ONNX run and cache mutation at a time
        self.steps, self.step_s, self.compute_s = 0, 0.0, 0.0  # where a replica's time goes
        self.health_probes = 0
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
        """Make sure the (current) KV manager knows this replica's pool. After the
        manager was restarted it knows nothing: re-register with every live sequence's
        granted blocks, so its ledger is whole again and no block is granted twice."""
        kv = kv_manager_handle()
        if ray.get(kv.has_pool.remote(self.replica_id), timeout=10):
            self.kv = kv
            return
        cache = self.decoder.cache
        with self._lock:
            live = self.worker.live_grants()
        ray.get(kv.register_pool.remote(self.replica_id, cache.num_blocks, cache.block_size, live), timeout=10)
        self.kv = kv

    def describe(self) -> dict:
        """What a router needs to know once: limits, EOS, outputs, and who allocates KV."""
        self._ensure_registered()
        decoder = self.decoder.decoder
        return {"replica": self.replica_id, "eos_token_ids": list(self.decoder.eos_token_ids),
                "max_context": self.decoder.max_context, "vocab_size": decoder.vocab_size,
                "extra_outputs": sorted(decoder.io.extra_outputs), "kv_manager": self.kv,
                "providers": list(decoder.session.get_providers())}

    def verify_costs(self) -> VerifyCostTable:
        """This replica's measured verify costs (``engine.sched.costs``), for the router's
        adaptive speculation; measured once at start-up."""
        return self.worker.verify_costs()

    def step(self, prefills: Sequence[PrefillItem], verifies: Sequence[VerifyItem], releases: Sequence[Hashable],
             replica_hint: str | None = None) -> tuple[str, list[TargetResult]]:
        """One tick for the sequences on this replica; see ``TargetWorker.step``.

        A call meant for another replica (routed here because that one is gone) is
        refused untouched: its KV blocks were granted in the other replica's pool."""
        if replica_hint is not None and replica_hint != self.replica_id:
            return self.replica_id, []
        started = time.perf_counter()
        verifies = _resolve_probs(list(verifies))
        with self._lock:
            locked = time.perf_counter()
            results = self.worker.step(prefills, verifies, releases)
            self.compute_s += time.perf_counter() - locked
        anchors = {r.seq_id: r.outcome.anchor for r in results
                   if r.outcome is not None and _carries_data(r.outcome.anchor)}
        ref = ray.put(anchors) if anchors else None
        results = [r if r.outcome is None else dataclasses.replace(
            r, outcome=dataclasses.replace(r.outcome, anchor=ref if r.seq_id in anchors else None)) for r in results]
        self.steps += 1
        self.step_s += time.perf_counter() - started
        return self.replica_id, results

    def kv_usage(self) -> dict:
        cache = self.decoder.cache
        return {"replica": self.replica_id, "total_blocks": cache.num_blocks, "free_blocks": cache.free_blocks,
                "sequences": len(self.worker.sequences), "steps": self.steps, "step_s": self.step_s,
                "compute_s": self.compute_s, "health_probes": self.health_probes}

    def check_health(self) -> None:
        """Probe the real ONNX session (``TargetWorker.probe``), so a stalled or broken
        model fails Serve's health check and the replica is replaced; and re-register
        with a KV manager that was restarted."""
        try:
            self._ensure_registered()
        except Exception as exc:  # noqa: BLE001 - the manager being away is not this replica's fault
            log.warning("KV manager not reachable yet (%s); will re-register on the next check", exc)
        self.health_probes += 1
        with self._lock:
            self.worker.probe()


def _carries_data(anchor) -> bool:
    return anchor is not None and (anchor.final is not None or anchor.layers is not None
                                   or anchor.shared_kv is not None)


def _resolve_probs(verifies: list[VerifyItem]) -> list[VerifyItem]:
    """Draft distributions come by reference from the proposer replica; fetch them here."""
    refs = [v.probs for v in verifies if isinstance(v.probs, ray.ObjectRef)]
    if not refs:
        return verifies
    values = dict(zip(refs, ray.get(refs)))
    return [dataclasses.replace(v, probs=values[v.probs][v.seq_id]) if isinstance(v.probs, ray.ObjectRef) else v
            for v in verifies]
