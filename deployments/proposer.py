"""A proposer deployment: one model-based proposer kind (draft model, MTP, EAGLE-3 or
shared-KV) with its own replicas and resources (``engine.sched.proposer_worker``).

Target hidden states and shared-KV slices arrive as ObjectRefs to the object the target
replica put in the store -- the router passes the references on without touching the
data. Sampled draft distributions go back the same way, as a reference."""
from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from pathlib import Path
from typing import Hashable, Sequence

import numpy as np
import ray
from ray import serve

from engine.model.manifest import BundleManifest
from engine.options import EngineConfig
from engine.spec.proposers.registry import load_proposer_factory
from engine.sched.proposer_worker import ProposeItem, ProposeResult, ProposerWorker


class ProposerModel:
    def __init__(self, bundle_dir: str, mode: str, engine_config: dict) -> None:
        self.mode = mode
        config = EngineConfig.model_validate(engine_config)
        bundle = Path(bundle_dir)
        manifest = BundleManifest.load(bundle)
        vocab = manifest.models["target"].architecture.vocab_size
        self.worker = ProposerWorker(load_proposer_factory(mode, bundle, manifest, config, vocab))
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._lock = threading.Lock()
        self.transport = Counter()  # how target data arrived: by reference (the design) or by value

    def propose(self, items: Sequence[ProposeItem], releases: Sequence[Hashable],
                replica_hint: str | None = None) -> tuple[str, list[ProposeResult]]:
        items = self._resolve_anchors(list(items))
        with self._lock:
            self.worker.release(releases)
            results = self.worker.propose(items)
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

    def transport_stats(self) -> dict:
        return {"replica": self.replica_id, "mode": self.mode, **self.transport,
                "sequences": len(self.worker.sequences)}

    def check_health(self) -> None:
        """Run the real ONNX session of this proposer on a minimal input."""
        with self._lock:
            probe = self.worker.factory()
            try:
                session = getattr(getattr(probe, "head", None), "session", None) or probe.draft.decoder.session
                feed = {}
                for spec in session.get_inputs():
                    shape = [d if isinstance(d, int) else (0 if "past" in spec.name else 1) for d in spec.shape]
                    dtype = np.int64 if "int64" in spec.type else (np.float16 if "float16" in spec.type else np.float32)
                    feed[spec.name] = np.zeros(shape, dtype)
                if "attention_mask" in feed:
                    feed["attention_mask"] = np.ones_like(feed["attention_mask"])
                outputs = session.run(None, feed)
            finally:
                probe.close()
        if not all(np.isfinite(o).all() for o in outputs if o.dtype.kind == "f"):
            raise RuntimeError(f"{self.mode} proposer produced non-finite outputs on the health probe")
