"""Batched propose -> verify rounds across workers, independent of how messages travel.

The coordinator owns request lifecycles and the tick loop. Each tick advances every
active sequence of a *lane* by one round with one proposer call per (mode, replica) and
one target call per target replica -- never one call per request -- and commits what
comes back through each request's ``SequenceDriver``. Over a transport whose calls can
overlap (remote workers), several lanes run concurrently, so one lane's proposer work
overlaps another lane's target pass (the one thing a disaggregated design can do that
a single-process engine cannot); in-process there is one lane.

The ``Transport`` is the only thing that differs between the two ways specserve runs:
the in-process ``Engine`` moves items by plain function calls (``LocalTransport``), the
Ray Serve router through its workers and the object store. The scheduler -- admission,
batching, failure handling -- is this one object either way.
"""
from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Hashable, NamedTuple, Protocol, Sequence

from specserve.engine.config import SchedulerConfig
from specserve.engine.errors import EngineError
from specserve.engine.kv.block_ledger import Grant
from specserve.engine.sched.background import detached
from specserve.engine.sched.call_clock import SerialCallClock
from specserve.engine.sched.cost_tables import DraftCostTable, VerifyCostTable
from specserve.engine.sched.adaptive_drafts import AdaptiveDrafts
from specserve.engine.sched.draft_policy import (DraftPolicy, ProposerCall, RoundPlan, RoundTime, SequenceRound,
                                                 TargetCall, TickReport)
from specserve.engine.sched.metrics import RoundMetrics
from specserve.engine.sched.messages import PrefillItem, ProposeItem, ProposeResult, TargetResult, VerifyItem
from specserve.engine.sched.sequence_driver import SequenceDriver

log = logging.getLogger("specserve.coordinator")


async def _within(call, seconds: float):
    """``call`` or ``TimeoutError`` after ``seconds`` (without a task per call on 3.11+)."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await call
    return await asyncio.wait_for(call, seconds)


class TargetUnavailableError(EngineError):
    """A target replica cannot be reached (it died or was replaced): its sequences' KV is
    gone, but their committed tokens are not."""


class RequestFailedError(EngineError):
    """A request could not be completed; the message says why."""


class Transport(Protocol):
    # Whether calls can be in flight at once (remote workers): only then do several
    # lanes overlap one lane's proposing with another's verifying.
    concurrent: bool

    async def admit(self, seq_id: Hashable, tokens: int, avoid: Sequence[str], prefix: Sequence[int] = ()) -> Grant:
        """Reserve ``tokens`` of KV, waiting for room; raises ``AdmissionError``. ``prefix``:
        the tokens the prefill feeds, whose cached blocks the grant shares."""

    async def admit_many(self, requests: list[tuple[Hashable, int, Sequence[int]]]) -> list[Grant]:
        """``admit`` for sequences that run together: all of them at once or none."""

    async def publish(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """The sequence's target holds final KV for ``tokens``: the ledger may share their blocks."""

    async def release(self, seq_id: Hashable, tokens: Sequence[int] | None = None) -> None:
        """The target freed the sequence; ``tokens``: those whose KV was final there."""

    async def target_step(self, replica: str, prefills: list[PrefillItem], verifies: list[VerifyItem],
                          releases: list[Hashable]) -> list[TargetResult]: ...

    async def propose(self, mode: str, replica: str | None, items: list[ProposeItem],
                      releases: list[Hashable]) -> tuple[str | None, list[ProposeResult]]: ...

    async def forget_target(self, replica: str) -> None:
        """A target replica is gone: its pool must stop taking admissions."""

    async def verify_costs(self) -> VerifyCostTable:
        """The target's measured cost of a verify pass by batch and rows (``sched.calibration``)."""

    async def draft_costs(self, mode: str) -> DraftCostTable:
        """A proposer mode's measured cost of a call by batch and drafts (``sched.calibration``)."""


@dataclass(eq=False)
class _Run:
    driver: SequenceDriver
    done: asyncio.Future
    grant: Grant | None = None
    proposer_replica: str | None = None
    cancelled: bool = False       # set by ``follow`` when its caller goes away; honoured next tick
    readmitting: asyncio.Task | None = None


@dataclass
class _Lane:
    runs: list[_Run] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    target_releases: dict[str, list[Hashable]] = field(default_factory=lambda: defaultdict(list))
    proposer_releases: dict[tuple[str, str | None], list[Hashable]] = field(default_factory=lambda: defaultdict(list))
    kv_releases: list[Hashable] = field(default_factory=list)
    final_tokens: dict[Hashable, list[int]] = field(default_factory=dict)  # retired sequences' final-KV tokens
    kv_publishes: list[tuple[Hashable, list[int]]] = field(default_factory=list)  # finished prefills, for the ledger
    released_again: set = field(default_factory=set)  # proposer releases already re-sent once after a failed call
    task: asyncio.Task | None = None
    ticking: bool = False  # releases are in flight inside a tick
    members: dict[str, frozenset] = field(default_factory=dict)  # target replica -> its last call's sequences
    report: TickReport = field(default_factory=TickReport)  # what this tick saw, for the draft policy
    # when its last tick ended, while it has had work since and that tick ran no prefill:
    # what lies between two ticks is a round's cost too (``VerifyCostModel.observe_gap``)
    tick_ended: float | None = None

    @property
    def has_work(self) -> bool:
        return bool(self.runs or self.ticking or self.kv_releases or self.kv_publishes
                    or any(self.target_releases.values()) or any(self.proposer_releases.values()))


class _Choice(NamedTuple):
    """A sequence's part of its call's plan this tick (``RoundPlan``)."""

    num_drafts: int
    steps: int
    anchor: bool


@dataclass
class TickTimings:
    """Where a coordinator's time goes (seconds, summed over ticks)."""

    ticks: int = 0
    rounds: int = 0          # sequence-rounds advanced
    propose_s: float = 0.0
    target_s: float = 0.0
    tick_s: float = 0.0


class RoundCoordinator:
    """Admission, batching and failure handling for every request, in-process or served.

    Admission reserves each request's worst case (``SequenceDriver.kv_tokens``) before
    its first round, waiting for room; a round can then never run out of KV, so there is
    no preemption and no recomputation (docs/architecture.md says why).
    A proposer that fails or stalls costs speed, never correctness: its sequences run
    rounds without drafts for ``proposer_backoff_s``, then try again (a replacement
    replica re-syncs from the whole context).
    """

    def __init__(self, transport: Transport, config: SchedulerConfig | None = None,
                 metrics: RoundMetrics | None = None, policy: DraftPolicy | None = None) -> None:
        """``policy``: how many drafts each round verifies (``sched.draft_policy``); by
        default adaptive for the requests that adapt, their maximum for the others."""
        self.transport = transport
        self.config = config = config or SchedulerConfig()
        self.metrics = metrics or RoundMetrics()
        self.proposer_timeout_s, self.proposer_backoff_s = config.proposer_timeout_s, config.proposer_backoff_s
        self._proposer_down_until: dict[str, float] = {}
        self._forgotten: set[str] = set()
        self._forgetting: asyncio.Future | None = None
        self._lanes = [_Lane() for _ in range(config.lanes if transport.concurrent else 1)]
        self.max_batch = config.max_batch_size  # per lane and tick; the rest wait their turn (FIFO)
        self.timings = TickTimings()
        self._call_clock = SerialCallClock()  # what a call cost, less its wait behind other lanes' calls
        self.policy = policy or AdaptiveDrafts(transport, config.plain_steps, config.replan_rounds)
        self.waiting = 0  # sequences waiting for their KV to be admitted

    @property
    def active(self) -> int:
        return sum(len(lane.runs) for lane in self._lanes)

    async def run(self, driver: SequenceDriver) -> None:
        """Admit the request and advance it until it finishes; raises on failure."""
        await self.follow(await self.admit(driver))

    async def admit(self, driver: SequenceDriver) -> "_Run":
        """Reserve the request's KV (waiting for room) and put it in a lane. Raises the
        admission error, so a server can answer 503 before it starts a stream."""
        return (await self.admit_many([driver]))[0]

    async def admit_many(self, drivers: Sequence[SequenceDriver]) -> list["_Run"]:
        """``admit`` for sequences that run together (a request's choices): their KV is
        reserved all at once or not at all, so a request never holds part of what it
        needs while waiting for the rest, and one that could never fit whole fails at once."""
        loop = asyncio.get_running_loop()
        runs = [_Run(driver, loop.create_future()) for driver in drivers]
        queries = [driver.cache_query for driver in drivers]
        self.waiting += len(drivers)
        try:
            if len(drivers) == 1:
                grants = [await self.transport.admit(drivers[0].seq_id, drivers[0].kv_tokens, [], queries[0])]
            else:
                grants = await self.transport.admit_many([(driver.seq_id, driver.kv_tokens, query)
                                                          for driver, query in zip(drivers, queries)])
        except asyncio.CancelledError:
            for driver in drivers:  # an admit may land after we left
                detached(self.transport.release(driver.seq_id))
            raise
        finally:
            self.waiting -= len(drivers)
        for run, grant, query in zip(runs, grants, queries):
            self._granted(run, grant, query)
            lane = self._lane_with_room()
            lane.runs.append(run)
            self._ensure_running(lane)
        return runs

    def _lane_with_room(self) -> _Lane:
        """The first lane with room in a tick (``max_batch_size``), else the one with the
        fewest sequences. Lanes overlap one lane's calls with another's, but each worker
        serves one call at a time, and a target pass at a small batch costs about what a
        pass of one sequence does (memory-bound): two half-size calls that take turns on
        the worker cost nearly twice one batched call, far more than the proposer hop the
        overlap hides (docs/architecture.md measures both). So sequences share one
        batched call per replica and tick, and lanes take what one tick cannot."""
        for lane in self._lanes:
            if len(lane.runs) < self.max_batch:
                return lane
        return min(self._lanes, key=lambda la: len(la.runs))

    def _granted(self, run: "_Run", grant: Grant, query: Sequence[int]) -> None:
        """A run got its KV: count the prefix-cache lookup (vLLM's queries and hits, in
        tokens); a request's cached tokens are those of its first prefill."""
        run.grant = grant
        if query:
            self.metrics.prefix_cache(len(query), grant.cached_tokens)
        if not run.driver.prefilled:
            run.driver.cached_tokens = grant.cached_tokens

    async def follow(self, run: "_Run") -> None:
        """Wait for an admitted request to finish. Cancelling the caller (a client
        disconnect) retires the request at the next tick and frees its KV."""
        try:
            await asyncio.shield(run.done)
        except asyncio.CancelledError:
            run.cancelled = True
            for lane in self._lanes:
                lane.wake.set()
            raise

    async def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every lane has sent its pending releases (tests, graceful shutdown);
        False if that took longer than ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while any(lane.has_work for lane in self._lanes):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.005)
        return True

    def _ensure_running(self, lane: _Lane) -> None:
        lane.wake.set()
        if lane.task is None or lane.task.done():
            lane.task = detached(self._lane_loop(lane))

    async def _lane_loop(self, lane: _Lane) -> None:
        while True:
            if not lane.has_work:
                lane.tick_ended = None  # idle, not a gap a round pays
                lane.wake.clear()
                await lane.wake.wait()
                continue
            lane.ticking = True
            try:
                await self._tick(lane)
            except Exception as exc:  # noqa: BLE001 - never leave a request waiting forever
                log.exception("coordinator tick failed; failing its requests")
                for run in list(lane.runs):
                    self._retire(lane, run, RequestFailedError(f"internal error: {exc}"))
            finally:
                lane.ticking = False
            if lane.runs and all(r.grant is None for r in lane.runs) and not lane.kv_releases:
                lane.tick_ended = None
                await asyncio.sleep(0.01)  # only re-admissions pending: do not spin
            else:
                # Yield to the loop between ticks: in-process transport calls never suspend, so
                # without this, requests arriving (or woken by freed blocks) during a busy lane
                # would not even be admitted until the lane ran out of work.
                await asyncio.sleep(0)

    # -- one tick ------------------------------------------------------------------------
    async def _tick(self, lane: _Lane) -> None:
        started = time.perf_counter()
        gap = None if lane.tick_ended is None else started - lane.tick_ended
        lane.tick_ended = None
        for run in list(lane.runs):
            if run.cancelled or run.driver.finished:
                self._retire(lane, run)
        ready = [r for r in lane.runs if r.grant is not None][: self.max_batch]
        prefilling = [r for r in ready if r.driver.needs_prefill]
        decoding = [r for r in ready if not r.driver.needs_prefill]

        self._propose_locally(decoding)
        choices = await self._plan(decoding)
        proposals = self._propose_calls(lane, decoding, choices)
        calling = time.perf_counter()
        results = await self._gather(proposals.values())
        in_calls = time.perf_counter() - calling
        for (mode, replica), outcome in zip(proposals, results):
            self._take_proposals(lane, mode, replica, outcome)
        propose_done = time.perf_counter()

        target_calls = self._target_calls(lane, prefilling, decoding, choices)
        calling = time.perf_counter()
        outcomes = await self._gather(call for call, _ in target_calls.values())
        in_calls += time.perf_counter() - calling
        for (replica, (_, runs)), outcome in zip(target_calls.items(), outcomes):
            self._take_target_results(lane, replica, runs, outcome)
        publishes, lane.kv_publishes = lane.kv_publishes, []
        kv_releases, lane.kv_releases = lane.kv_releases, []
        if publishes or kv_releases:
            await self._update_ledger(publishes, kv_releases, lane.final_tokens)

        for run in list(lane.runs):
            if run.driver.finished:
                self._retire(lane, run)
        finished = time.perf_counter()
        report, lane.report = lane.report, TickReport()
        report.time = RoundTime(len(decoding), len(prefilling), any(c.steps > 1 for c in choices.values()),
                                finished - started - in_calls, gap)
        self.policy.observe(report)
        if not prefilling:
            lane.tick_ended = finished
        t = self.timings
        t.ticks, t.rounds = t.ticks + 1, t.rounds + len(prefilling) + len(decoding)
        t.propose_s += propose_done - started
        t.target_s += finished - propose_done
        t.tick_s += finished - started
        self.metrics.tick(finished - started, self.active)

    def _propose_locally(self, decoding: list[_Run]) -> None:
        """Model-free proposers (prompt lookup) draft first, at their maximum: it costs
        next to nothing, and the plan then knows what each of them actually found."""
        for run in decoding:
            driver = run.driver
            if driver.local_proposer is None:
                continue
            try:
                if driver.propose_locally(driver.max_num_drafts()):
                    self.metrics.draft_lookup(driver.mode, driver.drafted > 0)
            except Exception as exc:  # noqa: BLE001 - a proposer failure costs drafts, never the request
                log.warning("in-coordinator proposer %s failed for %s: %r", driver.mode, driver.seq_id, exc)
                self.metrics.fault("proposer_failed", driver.mode)
                driver.no_drafts()

    async def _plan(self, decoding: list[_Run]) -> dict[_Run, _Choice]:
        """Every decoding sequence's drafts, plain rounds and anchor this tick, as the draft
        policy plans each target call (an in-coordinator proposer's drafts are cut to its
        plan's)."""
        calls: dict[str, list[_Run]] = defaultdict(list)
        for run in decoding:
            calls[run.grant.replica].append(run)
        plans: list[RoundPlan] = await self.policy.plan([[run.driver for run in runs] for runs in calls.values()])
        choices = {}
        for runs, plan in zip(calls.values(), plans):
            for run, num_drafts, anchor in zip(runs, plan.num_drafts, plan.anchors or [True] * len(runs)):
                choices[run] = _Choice(num_drafts, plan.steps, anchor)
                driver = run.driver
                if driver.local_proposer is not None:
                    driver.keep_drafts(num_drafts)
                if driver.adaptive:
                    self.metrics.draft_length(driver.mode, num_drafts)
        return choices

    async def _gather(self, calls) -> list:
        """Await calls, returning exceptions in place of results. A transport whose calls
        cannot overlap (in-process) awaits them in turn: no task per call on the hot path."""
        calls = list(calls)
        if self.transport.concurrent:
            return await asyncio.gather(*calls, return_exceptions=True)
        results = []
        for call in calls:
            try:
                results.append(await call)
            except Exception as exc:  # noqa: BLE001 - handed back like gather(return_exceptions=True)
                results.append(exc)
        return results

    async def _release_all(self, seq_ids: list[Hashable]) -> None:
        """Give requests' blocks back to the ledger, caching nothing of theirs (their
        target may no longer hold them)."""
        await self._update_ledger([], seq_ids, {})

    async def _update_ledger(self, publishes: list[tuple[Hashable, list[int]]], releases: list[Hashable],
                             final_tokens: dict[Hashable, list[int]]) -> None:
        """Tell the ledger which prefills finished (their blocks may be shared now) and
        which requests' blocks are back (``final_tokens`` pops each one's tokens of final
        KV, which stay cached). A release that fails is logged and counted, never dropped
        in silence: the blocks stay reserved until the ledger is rebuilt (a restarted KV
        manager re-registers pools from their live sequences); a failed publish only
        means those blocks are not shared."""
        calls = [self.transport.publish(seq_id, tokens) for seq_id, tokens in publishes]
        calls += [self.transport.release(seq_id, final_tokens.pop(seq_id, None)) for seq_id in releases]
        results = await self._gather(calls)
        for n, result in enumerate(results):
            if isinstance(result, BaseException):
                published = n < len(publishes)
                seq_id = publishes[n][0] if published else releases[n - len(publishes)]
                log.warning("%s the KV blocks of %s failed: %r", "publishing" if published else "releasing", seq_id,
                            result)
                self.metrics.fault("ledger_publish_failed" if published else "ledger_release_failed")

    def _propose_calls(self, lane: _Lane, decoding: list[_Run], choices: dict[_Run, _Choice]) -> dict:
        groups: dict[tuple[str, str | None], list[tuple[_Run, ProposeItem]]] = defaultdict(list)
        now = time.monotonic()
        for run in decoding:
            driver = run.driver
            if driver.local_proposer is not None:
                continue  # drafted before the plan (``_propose_locally``)
            if self._proposer_down_until.get(driver.mode, 0.0) > now:
                driver.no_drafts()
                continue
            item = driver.propose_item(choices[run].num_drafts)
            if item is not None:
                groups[(driver.mode, run.proposer_replica)].append((run, item))
        keys = set(groups) | {k for k, v in lane.proposer_releases.items() if v}
        calls = {}
        for key in keys:
            releases, lane.proposer_releases[key] = lane.proposer_releases.get(key, []), []
            pairs = groups.get(key, [])
            calls[key] = self._propose_group(lane, key, pairs, releases)
        return calls

    async def _propose_group(self, lane: _Lane, key, pairs, releases):
        mode, replica = key
        started = self._call_clock.now()
        try:
            served_by, results = await _within(
                self.transport.propose(mode, replica, [item for _, item in pairs], releases), self.proposer_timeout_s)
        except Exception:
            # The call may never have reached the worker: send its releases again with the
            # next call (once -- a replica that is gone has forgotten those sequences anyway).
            retry = [s for s in releases if s not in lane.released_again]
            lane.released_again.update(retry)
            lane.proposer_releases[key].extend(retry)
            raise
        seconds, own = self._call_clock.finished(("proposer", mode, served_by), started)
        if pairs:
            self.metrics.draft_call(mode, seconds)
            lane.report.proposer_calls.append(ProposerCall(
                mode, [item.num_drafts for _, item in pairs], [item.since for _, item in pairs],
                [len(item.new_tokens) for _, item in pairs], [run.driver.num_drafts for run, _ in pairs], own))
        return served_by, [(run, result) for (run, _), result in zip(pairs, results)]

    def _take_proposals(self, lane: _Lane, mode: str, replica: str | None, outcome) -> None:
        if isinstance(outcome, BaseException):
            # A proposer replica failed: these rounds go without drafts (still exact).
            log.warning("proposer %s (replica %s) failed: %r; rounds go without its drafts for %.1f s", mode,
                        replica, outcome, self.proposer_backoff_s)
            self.metrics.fault("proposer_timeout" if isinstance(outcome, (asyncio.TimeoutError, TimeoutError))
                               else "proposer_failed", mode)
            self._proposer_down_until[mode] = time.monotonic() + self.proposer_backoff_s
            for run in lane.runs:
                if run.driver.mode == mode and run.proposer_replica == replica:
                    run.proposer_replica = None
                    run.driver.take_proposal(ProposeResult(run.driver.seq_id, [], resync=True))
            return
        served_by, pairs = outcome
        for run, result in pairs:
            run.proposer_replica = served_by
            if result.error:
                log.warning("proposer %s failed for %s: %s", mode, result.seq_id, result.error)
                self.metrics.fault("proposer_failed", mode)
            run.driver.take_proposal(result)

    def _target_calls(self, lane: _Lane, prefilling: list[_Run], decoding: list[_Run],
                      choices: dict[_Run, _Choice]) -> dict:
        groups: dict[str, tuple[list, list, list[_Run]]] = {}
        for run in prefilling:
            prefills, _, runs = groups.setdefault(run.grant.replica, ([], [], []))
            prefills.append(run.driver.prefill_item(run.grant.blocks, run.grant.prefix_blocks))
            runs.append(run)
        for run in decoding:
            _, verifies, runs = groups.setdefault(run.grant.replica, ([], [], []))
            choice = choices[run]
            verifies.append(run.driver.verify_item(choice.steps, choice.anchor))
            runs.append(run)
        for replica, releases in lane.target_releases.items():
            if releases:
                groups.setdefault(replica, ([], [], []))
        calls = {}
        for replica, (prefills, verifies, runs) in groups.items():
            releases, lane.target_releases[replica] = lane.target_releases.get(replica, []), []
            # Whether the call's sequences are the replica's last call's: a call that pays for
            # arrivals and departures teaches the draft policy nothing (``TargetCall``).
            members = frozenset(item.seq_id for item in verifies)
            changed = members != lane.members.get(replica)
            lane.members[replica] = members
            calls[replica] = (self._target_group(lane, replica, prefills, verifies, releases, changed), runs)
        return calls

    async def _target_group(self, lane: _Lane, replica, prefills, verifies, releases, changed: bool = False):
        started = self._call_clock.now()
        results = await self.transport.target_step(replica, prefills, verifies, releases)
        seconds, own = self._call_clock.finished(("target", replica), started)
        if prefills or verifies:
            self.metrics.verify_call(seconds)
            # a call merged with another router's teaches nothing of its own rows
            changed = changed or any(result.merged_call for result in results)
            lane.report.target_calls.append(TargetCall([len(item.drafts) + 1 for item in verifies],
                                                       [item.steps for item in verifies], len(prefills), changed, own))
        return results, releases

    def _take_target_results(self, lane: _Lane, replica: str, runs: list[_Run], outcome) -> None:
        if isinstance(outcome, TargetUnavailableError):
            log.warning("target replica %s is gone; re-prefilling its %d sequences elsewhere", replica, len(runs))
            self._forget_target(replica)
            for run in runs:
                self._lose_target(lane, run)
            return
        if isinstance(outcome, BaseException):
            for run in runs:
                self._retire(lane, run, RequestFailedError(f"target failed: {outcome}"))
            return
        results, releases = outcome
        lane.kv_releases.extend(releases)  # the target freed their pages: now the ledger may reuse them
        for run, result in zip(runs, results):
            if result.unknown_sequence:
                self._lose_target(lane, run)
            elif result.error is not None:
                self._retire(lane, run, RequestFailedError(result.error))
            else:
                if run.driver.needs_prefill:  # its target named the prefill's full blocks: so may the ledger
                    lane.kv_publishes.append((run.driver.seq_id, run.driver.prefill_tokens))
                try:
                    rounds = run.driver.complete(result.outcome, result.outcome.anchor, result.more)
                except Exception as exc:  # noqa: BLE001 - e.g. a streaming consumer that went away
                    self._retire(lane, run, exc)
                    continue
                self.timings.rounds += len(rounds) - 1 if rounds else 0  # the tick counted one
                for verified in rounds:
                    self.metrics.verify_round(run.driver.mode, verified.num_drafts, verified.accepted,
                                              verified.committed)
                    lane.report.rounds.append(SequenceRound(run.driver.seq_id, run.driver.mode, verified.num_drafts,
                                                            verified.accepted, verified.draft_class))

    def _forget_target(self, replica: str) -> None:
        if replica not in self._forgotten:
            self._forgotten.add(replica)
            self._forgetting = detached(self.transport.forget_target(replica))

    def _lose_target(self, lane: _Lane, run: _Run) -> None:
        """Re-admit on another replica and re-prefill from the committed tokens."""
        log.warning("sequence %s lost its KV on target replica %s; re-admitting and re-prefilling it",
                    run.driver.seq_id, run.grant.replica)
        self.metrics.fault("target_lost")
        lost = run.grant.replica
        run.grant = None
        run.driver.lost_target()

        async def readmit() -> None:
            if self._forgetting is not None:
                await asyncio.gather(self._forgetting, return_exceptions=True)
            await self._release_all([run.driver.seq_id])
            query = run.driver.cache_query
            try:
                grant = await self.transport.admit(run.driver.seq_id, run.driver.kv_tokens, [lost], query)
            except Exception as exc:  # noqa: BLE001
                self._retire(lane, run, RequestFailedError(f"could not move the request to a live target: {exc}"))
                return
            finally:
                run.readmitting = None
            if run in lane.runs:
                self._granted(run, grant, query)
            else:  # retired (cancelled) while it waited: give the new grant straight back
                lane.kv_releases.append(run.driver.seq_id)
            lane.wake.set()

        run.readmitting = detached(readmit())

    # -- endings -------------------------------------------------------------------------
    def _retire(self, lane: _Lane, run: _Run, error: BaseException | None = None) -> None:
        if run in lane.runs:
            lane.runs.remove(run)
        seq_id = run.driver.seq_id
        try:
            run.driver.close()
        except Exception as exc:  # noqa: BLE001 - a proposer's bookkeeping never fails the request
            log.warning("closing the in-coordinator proposer of %s failed: %r", seq_id, exc)
            self.metrics.fault("proposer_failed", run.driver.mode)
        lane.report.retired.append(seq_id)
        if run.grant is not None:
            lane.target_releases[run.grant.replica].append(seq_id)  # then the ledger, once the pages are free
            final = run.driver.final_tokens
            if final is not None:
                lane.final_tokens[seq_id] = final  # their blocks stay cached, on the target and in the ledger
            run.grant = None
        elif run.readmitting is None:
            lane.kv_releases.append(seq_id)
        if run.driver.remote_proposer and run.proposer_replica is not None:
            lane.proposer_releases[(run.driver.mode, run.proposer_replica)].append(seq_id)
        if not run.done.done():
            if error is not None:
                run.done.set_exception(error)
            else:
                run.done.set_result(None)
