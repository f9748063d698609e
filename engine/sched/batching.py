"""Continuous batching: every tick advances each active sequence by one round, and all
their verify passes share one target call.

Sequences join (their prefill runs on its own, unpadded) and leave (finished, failed or
cancelled) between ticks. When the KV pool runs short, the newest sequence is preempted:
its blocks are freed and it waits to be re-prefilled from its committed tokens (vLLM's
"recompute" preemption), so greedy output is unchanged. All cache and proposer state is
touched only from the thread that calls ``step``; ``BatchEngineLoop`` runs that thread
for the in-process engine.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from engine.model.cached_decoder import CachedDecoder
from engine.kv.paged_cache import KVCacheCapacityError
from engine.spec.rounds import SequenceRounds

log = logging.getLogger("specserve.engine")


@dataclass(eq=False)
class Job:
    """A request on its way through the scheduler."""

    start: Callable[[], SequenceRounds]       # builds proposer + cache sequence (scheduler thread)
    finish: Callable[[SequenceRounds], None]  # releases them (scheduler thread)
    prompt_len: int
    done: threading.Event = field(default_factory=threading.Event)
    rounds: SequenceRounds | None = None
    error: BaseException | None = None
    cancelled: bool = False  # set from any thread (e.g. a client disconnect); honoured next tick

    @property
    def tokens_to_prefill(self) -> int:
        return self.prompt_len if self.rounds is None else len(self.rounds.state.tokens)


class BatchScheduler:
    def __init__(self, target: CachedDecoder, max_batch: int = 16) -> None:
        self.target, self.max_batch = target, max_batch
        self.waiting: deque[Job] = deque()
        self.active: list[Job] = []

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.active

    def submit(self, job: Job) -> None:
        self.waiting.append(job)

    def step(self) -> None:
        """One tick: admit and prefill newcomers, then one batched round for the rest."""
        self._admit_waiting()
        plans = []
        for job in list(self.active):
            if not self._settle(job):
                self._guard(job, lambda: plans.append((job, job.rounds.plan())))
        plans = self._fit_capacity([(j, p) for j, p in plans if j in self.active])
        if plans:
            try:
                outputs = self.target.feed_batch([p for _, p in plans])
            except Exception:  # noqa: BLE001 - isolate the sequence that broke the batch
                log.exception("batched target call failed; retrying its %d sequences one by one", len(plans))
                outputs = None
            for i, (job, plan) in enumerate(plans):
                self._guard(job, lambda: job.rounds.complete(
                    outputs[i] if outputs is not None else self.target.feed_batch([plan])[0]))
        for job in list(self.active):
            self._settle(job)

    # -- admission and capacity ------------------------------------------------------------
    def _blocks_for(self, tokens: int) -> int:
        cache = self.target.cache
        needed = -(-tokens // cache.block_size)
        if cache.sliding_window is not None:
            needed = min(needed, -(-cache.sliding_window // cache.block_size) + 1)
        return needed

    def _admit_waiting(self) -> None:
        """FIFO admission; a prompt waits until the pool has room for it plus one block of
        headroom per running sequence, and one that could never fit fails now."""
        cache = self.target.cache
        while self.waiting and len(self.active) < self.max_batch:
            job = self.waiting[0]
            needed = self._blocks_for(job.tokens_to_prefill)
            if job.cancelled or needed > cache.num_blocks:
                self.waiting.popleft()
                if not job.cancelled:
                    job.error = KVCacheCapacityError(
                        f"prompt of {job.tokens_to_prefill} tokens needs {needed} KV blocks; the pool has "
                        f"{cache.num_blocks} in all")
                self._retire(job)
                continue
            if needed + len(self.active) > cache.free_blocks and self.active:
                return  # wait for running sequences to finish
            self.waiting.popleft()
            self._guard(job, lambda: self._admit(job))

    def _admit(self, job: Job) -> None:
        if job.rounds is None:
            job.rounds = job.start()
        self.active.append(job)
        job.rounds.complete(self.target.feed_batch([job.rounds.plan()])[0])

    def _fit_capacity(self, plans):
        """Preempt the newest sequences until this tick's rounds fit in the pool; a
        sequence that cannot fit even alone fails with the capacity error."""
        cache = self.target.cache
        while plans:
            needed = sum(cache.blocks_needed(p.seq_id, len(p.tokens)) for _, p in plans)
            if needed <= cache.free_blocks:
                return plans
            job, plan = plans.pop()
            if not plans:
                self._fail(job, KVCacheCapacityError(
                    f"sequence {plan.seq_id} needs {needed} KV blocks, {cache.free_blocks} free"))
                return []
            self._guard(job, lambda: self._preempt(job))
        return plans

    def _preempt(self, job: Job) -> None:
        job.rounds.preempt()
        self.active.remove(job)
        self.waiting.appendleft(job)

    # -- endings ---------------------------------------------------------------------------
    def _guard(self, job: Job, action: Callable[[], None]) -> None:
        """Run one job's step; its failure ends that job only, never the batch."""
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - reported to the request that caused it
            self._fail(job, exc)

    def _fail(self, job: Job, exc: BaseException) -> None:
        job.error = exc
        self._retire(job)

    def _settle(self, job: Job) -> bool:
        """Retire the job if it finished or was cancelled; returns True if retired."""
        if job.done.is_set() or job.cancelled or job.rounds.finished:
            self._retire(job)
            return True
        return False

    def _retire(self, job: Job) -> None:
        if job in self.active:
            self.active.remove(job)
        if job.done.is_set():
            return
        if job.rounds is not None:
            try:
                job.finish(job.rounds)
            except Exception as exc:  # noqa: BLE001
                job.error = job.error or exc
        job.done.set()

    def fail_all(self, exc: BaseException) -> None:
        for job in list(self.active) + list(self.waiting):
            self._fail(job, exc)
        self.waiting.clear()


class BatchEngineLoop:
    """A daemon thread that ticks a scheduler while it has work."""

    def __init__(self, scheduler: BatchScheduler) -> None:
        self.scheduler = scheduler
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="specserve-batch", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._wake:
            self.scheduler.submit(job)
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while self.scheduler.idle:
                    self._wake.wait()
            try:
                self.scheduler.step()  # outside the lock: callbacks may submit more work
            except Exception as exc:  # noqa: BLE001 - never leave a caller waiting forever
                log.exception("batch scheduler step failed; failing its requests")
                self.scheduler.fail_all(exc)
