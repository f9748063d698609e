"""Worker actors: where a target or proposer replica's model really runs, called by the
router once per tick with a plain Ray actor call.

Why not the replica itself: a Serve ``DeploymentHandle`` call costs several times what a
raw actor call does (docs/architecture.md), and a round makes one per proposer and one
per target, so Serve's request path would cost more than the model work.
Serve keeps what it is good at -- the replica's lifecycle, health checks, autoscaling,
the HTTP ingress -- and the replica is a thin shell that owns its worker, as Ray Serve
LLM's engine replicas own their workers:

- the worker is created by the replica in the replica's own placement group (bundle 1
  of ``placement_group_bundles``), so its CPUs/GPUs are the replica's and the scheduler
  accounts for them;
- it is owned by the replica, so it dies with it (Ray fate-shares an actor with its
  owner), and a replica that Serve replaces brings a new worker;
- the replica's health check probes the model through the worker.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Hashable, Sequence

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from specserve.engine.assembly import proposer_worker, target_worker
from specserve.engine.config import EngineConfig
from specserve.engine.model.bundle import Bundle
from specserve.engine.grammar.compiler import GrammarCompiler, grammar_compiler
from specserve.engine.model.cached_decoder import CachedDecoder, model_eos_token_ids
from specserve.engine.model.tokenizer import TextTokenizer
from specserve.engine.sched.cost_tables import DraftCostTable, VerifyCostTable
from specserve.engine.sched.messages import PrefillItem, ProposeItem, ProposeResult, TargetResult, VerifyItem
from specserve.engine.speculative.proposers.registry import PROPOSER_MODES

from .autoscaling import KV_BLOCKS_TOTAL, KV_BLOCKS_USED, POLICY_PATH, SEQUENCES, reads_replica_load
from .kv_manager import LEASE_S, owner_of
from .metrics import ServeWorkerMetrics
from .step_merging import StepMerger

log = logging.getLogger("specserve.workers")
WORKER_BUNDLE = 1  # bundle 0 of a tick deployment's placement group is the replica shell's
# Threads of the target's calls at batch 1 (its in-place graph, spinning within a run only)
# unless the config sets ``in_place_threads``, capped by the node's cores. A batch-1 call is
# a replica with one sequence, i.e. a light load, where cores beyond the reservation are
# idle; at load, calls batch and keep to the reservation (docs/benchmarks/ measures both).
LONE_SEQUENCE_THREADS = 2
# A proposer worker drops a sequence it has not drafted for in this long: its router died
# (whose lease the KV manager ends after LEASE_S), or drafting is off for it, and then
# its next round resyncs it, which is always correct.
ORPHANED_AFTER_S = 2 * LEASE_S
ACTIVE_WITHIN_S = 5.0  # a proposer worker's sequence is load if drafted for this recently


def worker_bundles(cpus: float, gpus: float = 0.0) -> list[dict[str, float]]:
    """``placement_group_bundles`` for a replica shell plus its worker: the shell needs
    next to nothing; the worker gets the replica's compute."""
    return [{"CPU": 0.01}, {"CPU": cpus, **({"GPU": gpus} if gpus else {})}]


def calls_go_direct() -> bool:
    """Whether the router may call this replica's worker directly every round: yes,
    unless the deployment autoscales on Serve's default policy, which sizes it from the
    requests its handles route -- those rounds stay on Serve's path (and pay for it). A
    deployment that autoscales on its replicas' own load (``autoscaling.ReplicaLoadPolicy``)
    goes direct like a fixed one."""
    from ray import serve

    config = getattr(serve.get_replica_context(), "_deployment_config", None)
    scaling = config.autoscaling_config if config is not None else None
    if scaling is None or reads_replica_load(scaling.policy):
        return True
    log.warning("deployment %s autoscales on Serve's request-count policy, which cannot see rounds made to its "
                "workers directly: its rounds go through Serve (slower). Set autoscaling_config.policy to "
                "{policy_function: %s} to size it on its replicas' own load and call its workers directly",
                serve.get_replica_context().deployment, POLICY_PATH)
    return False


def spawn_worker(cls: type, *args, max_concurrency: int = 1):
    """Start ``cls(*args)`` as an actor in the calling replica's placement group (the
    worker bundle), or with no resources of its own when there is none (a replica
    deployed without ``placement_group_bundles``: its own resources then cover it)."""
    group = get_current_placement_group()
    if group is not None and len(group.bundle_specs) > WORKER_BUNDLE:
        bundle = group.bundle_specs[WORKER_BUNDLE]
        options = {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0),
                   "scheduling_strategy": PlacementGroupSchedulingStrategy(group, WORKER_BUNDLE)}
    else:
        options = {"num_cpus": 0}
    # One call at a time (a tick mutates the KV cache) unless the class serialises its own
    # calls (``TargetStepper``); no restarts: a dead worker means a dead replica, which
    # Serve replaces, and the router re-prefills its sequences.
    return ray.remote(cls).options(**options, max_restarts=0, max_concurrency=max_concurrency).remote(*args)


def worker_config(engine_config: dict) -> EngineConfig:
    """The engine config as a worker runs it: one process among several on the node, so
    its onnxruntime threads spin only while a run lasts and leave the cores to the router
    and the HTTP proxy between runs, and -- unless the config sets ``intra_op_threads`` --
    it gets as many threads as the CPUs Ray reserved for it (at least one). Threads that
    sleep between ops wake for every op, which makes a batched step about twice as slow,
    and threads that spin between runs too would starve the router (docs/design-decisions.md).
    Calls at batch 1 (the in-place graph's) get ``LONE_SEQUENCE_THREADS``: a lone sequence leaves
    cores idle."""
    config = EngineConfig.model_validate(engine_config)
    update: dict = {"thread_spinning": {"always": True, "within_run": "within_run", "never": False}[
        config.spinning(owns_cores=False)]}
    if config.intra_op_threads is None:
        reserved = sum(amount for name, amount in ray.get_runtime_context().get_assigned_resources().items()
                       if name == "CPU" or name.startswith("CPU_group_"))
        update["intra_op_threads"] = max(1, int(reserved))
    if config.in_place_threads is None:
        threads = update.get("intra_op_threads", config.intra_op_threads)
        update["in_place_threads"] = max(threads, min(LONE_SEQUENCE_THREADS, os.cpu_count() or 1))
    return config.model_copy(update=update)


class TargetStepper:
    """The target's ONNX session and the KV pages of the sequences on this replica.

    A threaded actor: several routers' ``step`` calls may wait at once, and
    ``StepMerger`` runs those that arrive together as one batched step
    (``step_merging.py``). Everything that reads or changes the session or the cache
    holds ``_lock``, so one thing runs at a time, as in a one-call-at-a-time actor."""

    def __init__(self, target_dir: str, engine_config: dict) -> None:
        config = worker_config(engine_config)
        self._lock = threading.RLock()
        self.decoder = CachedDecoder(Path(target_dir), config, owns_cores=False,
                                     graph_format=config.target_format)
        self.worker = target_worker(self.decoder, config, grammars_now=True)
        self.steps, self.step_s, self.compute_s = 0, 0.0, 0.0  # where the time goes
        self.merger = StepMerger(self._step)

    def describe(self) -> dict:
        decoder = self.decoder.decoder
        return {"eos_token_ids": list(self.decoder.eos_token_ids), "max_context": self.decoder.max_context,
                "vocab_size": decoder.vocab_size, "extra_outputs": sorted(decoder.io.extra_outputs),
                "providers": list(decoder.session.get_providers()), "num_blocks": self.decoder.cache.num_blocks,
                "block_size": self.decoder.cache.block_size, "prefix_caching": self.decoder.cache.prefix_caching}

    def verify_costs(self) -> VerifyCostTable:
        with self._lock:
            return self.worker.verify_costs()

    def live_grants(self) -> dict:
        with self._lock:
            return self.worker.live_grants()

    def pool_state(self) -> tuple[dict, dict]:
        """Live sequences' blocks and the named blocks, read together, for a KV manager
        that rebuilds its ledger."""
        with self._lock:
            return self.worker.live_grants(), self.worker.block_names()

    def probe(self) -> None:
        with self._lock:
            self.worker.probe()

    def step(self, replica: str, prefills: Sequence[PrefillItem], verifies: Sequence[VerifyItem],
             releases: Sequence[Hashable]) -> tuple[str, list[TargetResult]]:
        """One tick for one router's sequences on this replica (``TargetWorker.step``),
        run together with other routers' calls that arrive with it. Per sequence it
        returns O(k) data; the hidden-state anchors (and shared-KV slices) of the whole
        step go into the object store as one object, returned by reference."""
        items = [*prefills, *verifies]
        caller = (owner_of(items[0].seq_id) or "") if items else ""
        results, merged = self.merger.step(caller, prefills, verifies, releases)
        if merged:  # its time paid for other routers' rows too: not a price of its own
            results = [dataclasses.replace(r, merged_call=True) for r in results]
        return replica, results

    def _step(self, prefills: list[PrefillItem], verifies: list[VerifyItem],
              releases: list[Hashable]) -> list[TargetResult]:
        with self._lock:
            started = time.perf_counter()
            verifies = _resolve_probs(verifies)
            computing = time.perf_counter()
            results = self.worker.step(prefills, verifies, releases)
            self.compute_s += time.perf_counter() - computing
            anchors = {r.seq_id: r.outcome.anchor for r in results
                       if r.outcome is not None and r.outcome.anchor is not None and not r.outcome.anchor.empty}
            ref = ray.put(anchors) if anchors else None
            results = [r if r.outcome is None else dataclasses.replace(
                r, outcome=dataclasses.replace(r.outcome, anchor=ref if r.seq_id in anchors else None))
                for r in results]
            self.steps += 1
            self.step_s += time.perf_counter() - started
            return results

    def load(self) -> dict[str, float]:
        """What this replica serves, for the autoscaler (``autoscaling``): its sequences
        and the KV blocks reserved for them."""
        with self._lock:
            cache = self.decoder.cache
            return {SEQUENCES: len(self.worker.sequences), KV_BLOCKS_USED: cache.num_blocks - cache.free_blocks,
                    KV_BLOCKS_TOTAL: cache.num_blocks}

    def usage(self) -> dict:
        with self._lock:
            cache = self.decoder.cache
            return {"total_blocks": cache.num_blocks, "free_blocks": cache.free_blocks,
                    "cached_blocks": cache.cached_blocks, "sequences": len(self.worker.sequences),
                    "steps": self.steps, "step_s": self.step_s, "compute_s": self.compute_s,
                    "merged_steps": self.merger.merged_steps, **self._row_buffer_counts()}

    def _row_buffer_counts(self) -> dict[str, int]:
        rows = self.decoder.row_buffers
        return {} if rows is None else {"row_buffers_reused": rows.reused, "row_buffers_rebuilt": rows.rebuilt,
                                        "rows_placed": rows.placed}


class ProposerStepper:
    """One proposer mode's model and the drafting state of the sequences it serves."""

    def __init__(self, bundle_dir: str, mode: str, engine_config: dict) -> None:
        config = worker_config(engine_config)
        bundle = Bundle.load(bundle_dir)
        vocab = bundle.manifest.models["target"].architecture.vocab_size
        self.mode = mode
        self.metrics = ServeWorkerMetrics()
        self.worker = proposer_worker(PROPOSER_MODES[mode].load(bundle, config, vocab), self.metrics,
                                      functools.partial(_target_grammars, bundle.target_dir, vocab),
                                      grammars_now=True, idle_timeout_s=ORPHANED_AFTER_S)
        self.transport: Counter = Counter()  # how target data arrived (by reference: the design)
        self.calls, self.propose_s, self.compute_s = 0, 0.0, 0.0  # where the time goes

    def draft_costs(self) -> DraftCostTable:
        return self.worker.draft_costs()

    def probe(self) -> None:
        self.worker.probe()

    def propose(self, replica: str, items: Sequence[ProposeItem], releases: Sequence[Hashable]
                ) -> tuple[str, list[ProposeResult]]:
        started = time.perf_counter()
        items = self._resolve_anchors(list(items))
        self.worker.release(releases)
        computing = time.perf_counter()
        results = self.worker.propose(items)
        self.compute_s += time.perf_counter() - computing
        self.transport["drafted_rounds"] += sum(1 for r in results if r.tokens)
        probs = {r.seq_id: r.probs for r in results if r.probs is not None}
        if probs:  # [k, V] per sequence: by reference, never through the router's memory
            ref = ray.put(probs)
            results = [dataclasses.replace(r, probs=ref) if r.probs is not None else r for r in results]
        self.calls += 1
        self.propose_s += time.perf_counter() - started
        return replica, results

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

    def load(self) -> dict[str, float]:
        """What this replica serves, for the autoscaler and a drain: the sequences it has
        drafted for lately (a dead router's, waiting to be dropped, are no load)."""
        return {SEQUENCES: self.worker.active_sequences(ACTIVE_WITHIN_S)}

    def stats(self) -> dict:
        return {"mode": self.mode, **self.transport, "sequences": len(self.worker.sequences),
                "faults": dict(self.metrics.faults), "calls": self.calls, "propose_s": self.propose_s,
                "compute_s": self.compute_s}


def _target_grammars(target_dir: Path, vocab_size: int) -> GrammarCompiler:
    """The target model's grammar compiler, for drafting under a grammar: its tokenizer and
    end-of-sequence tokens, read from its directory (the worker never loads the target)."""
    tokenizer = TextTokenizer(target_dir)
    return grammar_compiler(tokenizer, vocab_size, model_eos_token_ids(target_dir, tokenizer))


def _resolve_probs(verifies: list[VerifyItem]) -> list[VerifyItem]:
    """Draft distributions come by reference from the proposer worker; fetch them here."""
    refs = [v.probs for v in verifies if isinstance(v.probs, ray.ObjectRef)]
    if not refs:
        return verifies
    values = dict(zip(refs, ray.get(refs)))
    return [dataclasses.replace(v, probs=values[v.probs][v.seq_id]) if isinstance(v.probs, ray.ObjectRef) else v
            for v in verifies]
