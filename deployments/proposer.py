"""A proposer deployment: one model-based proposer kind (draft model, MTP, EAGLE-3 or
shared-KV) with its own replicas and resources (``engine.sched.proposer_worker``). The
kind's model is loaded through the proposer registry, as the in-process engine loads it.

Target hidden states and shared-KV slices arrive as ObjectRefs to the object the target
replica put in the store -- the router passes the references on without touching the
data. Sampled draft distributions go back the same way, as a reference."""
from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from typing import Hashable, Sequence

import ray
from ray import serve

from engine.config import EngineConfig
from engine.model.bundle import Bundle
from engine.sched.costs import DraftCostTable
from engine.sched.proposer_worker import ProposeItem, ProposeResult, ProposerWorker
from engine.spec.proposers.registry import PROPOSER_KINDS

from .affinity import TICK_WORKER_OPTIONS
from .metrics import ServeWorkerMetrics
from .settings import ServeSettings


class ProposerModel:
    @classmethod
    def get_deployment_options(cls, settings: ServeSettings, mode: str) -> dict:
        """Serve options of ``mode``'s deployment (named by the registry); the builder
        layers ``deployment_overrides`` on top. A quarter of a GPU: four proposer
        replicas share one device."""
        gpu = settings.engine.device == "cuda"
        return {
            "name": PROPOSER_KINDS[mode].deployment,
            "max_ongoing_requests": 2 * settings.engine.scheduler.lanes,
            "ray_actor_options": {"num_cpus": 0.25, **({"num_gpus": 0.25} if gpu else {})},
            **TICK_WORKER_OPTIONS,
        }

    def __init__(self, bundle_dir: str, mode: str, engine_config: dict) -> None:
        self.mode = mode
        config = EngineConfig.model_validate(engine_config)
        # One replica among several on the node: resolve "auto" spinning as a replica does.
        config = config.model_copy(update={"thread_spinning": config.spinning(owns_cores=False)})
        bundle = Bundle.load(bundle_dir)
        vocab = bundle.manifest.models["target"].architecture.vocab_size
        self.metrics = ServeWorkerMetrics()
        self.worker = ProposerWorker(PROPOSER_KINDS[mode].load(bundle, config, vocab), self.metrics)
        self.worker.probe()  # a first real run: checks the model and warms its session up
        self.worker.draft_costs()  # timed now, for the router's adaptive speculation
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._lock = threading.Lock()
        self.transport = Counter()  # how target data arrived (by reference: the design) and what was served

    def propose(self, items: Sequence[ProposeItem], releases: Sequence[Hashable],
                replica_hint: str | None = None) -> tuple[str, list[ProposeResult]]:
        items = self._resolve_anchors(list(items))
        with self._lock:
            self.worker.release(releases)
            results = self.worker.propose(items)
        self.transport["drafted_rounds"] += sum(1 for r in results if r.tokens)
        probs = {r.seq_id: r.probs for r in results if r.probs is not None}
        if probs:  # [k, V] per sequence: by reference, never through the router's memory
            ref = ray.put(probs)
            results = [dataclasses.replace(r, probs=ref) if r.probs is not None else r for r in results]
        return self.replica_id, results

    def _resolve_anchors(self, items: list[ProposeItem]) -> list[ProposeItem]:
        refs = list({i.anchor for i in items if isinstance(i.anchor, ray.ObjectRef)})
        self.transport["anchor_refs"] += sum(isinstance(i.anchor, ray.ObjectRef) for i in items)
        self.transport["anchor_values"] += sum(i.anchor is not None and not isinstance(i.anchor, ray.ObjectRef)
                                               for i in items)
        bundles = dict(zip(refs, ray.get(refs))) if refs else {}
        resolved = []
        for item in items:
            if isinstance(item.anchor, ray.ObjectRef):
                anchor = bundles[item.anchor][item.seq_id]
                self.transport["shared_kv_slices"] += len(anchor.shared_kv or ())
                item = dataclasses.replace(item, anchor=anchor)
            resolved.append(item)
        return resolved

    def draft_costs(self) -> DraftCostTable:
        """This replica's measured draft costs (``engine.sched.costs``), measured at start-up."""
        return self.worker.draft_costs()

    def transport_stats(self, replica_hint: str | None = None) -> dict:
        """This replica's counters (``replica_hint`` pins the call to one replica)."""
        return {"replica": self.replica_id, "mode": self.mode, **self.transport,
                "sequences": len(self.worker.sequences), "faults": dict(self.metrics.faults)}

    def check_health(self) -> None:
        """Probe the real proposer model (``ProposerWorker.probe``)."""
        with self._lock:
            self.worker.probe()
