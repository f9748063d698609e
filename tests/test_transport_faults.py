"""Faults the scheduler must survive, injected between the coordinator and its workers.

``FaultyTransport`` wraps the engine's real ``LocalTransport``; it is the one fake in the
test suite. Every fault it injects is one the server's transport meets for real (a hung
or crashed proposer replica, a slow or unreachable KV manager, a replaced target
replica) but that the in-process engine cannot produce, because its workers are plain
function calls in this process: they neither hang, nor crash, nor lose a message.
Everything else -- coordinator, target worker, proposer workers, ledger, models -- is
the real thing, and each case checks the requests' tokens against a clean run.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Hashable, Sequence

import pytest

from specserve.engine import Engine, GenerationOptions, SchedulerConfig
from specserve.engine.sched.local_transport import LOCAL_REPLICA, LocalTransport

from .conftest import CPU_CONFIG, MODELS, assert_everything_released, generate_concurrently

PROPOSER_TIMEOUT_S = 1.0


class FaultyTransport:
    """``LocalTransport`` plus faults armed by the test. Each names the real failure it
    stands for and why the in-process engine cannot cause it for real:

    - ``stall_proposer(mode, call)``: the ``call``-th propose call for ``mode`` never returns -- a hung
      proposer replica (a local ``ProposerWorker`` returns or raises; it cannot hang).
      The coordinator must abandon it after ``proposer_timeout_s``.
    - ``crash_proposer(mode, call)``: that propose call raises -- a proposer replica that
      died mid-call (a local call cannot lose its worker).
    - ``lose_sequence(verify, hold_readmission)``: before the ``verify``-th verify pass, the
      real target worker drops the first sequence in it -- the target replica holding it
      was replaced. With ``hold_readmission``, the sequence's re-admission then waits until
      ``open_readmission()`` -- a slow KV manager (local admission never blocks on a
      remote call), so the test can cancel the request while it re-admits.
    - ``fail_release(count)``: the next ``count`` ledger releases raise without releasing --
      an RPC to the KV-manager actor that was lost (a local release is a dict update).
    """

    def __init__(self, inner: LocalTransport) -> None:
        self.inner = inner
        self.concurrent = inner.concurrent
        self._propose_calls: dict[str, int] = {}
        self._stall: dict[str, int] = {}
        self._crash: dict[str, int] = {}
        self._lose_at: int | None = None
        self._verifies = 0
        self._hold_readmission = False
        self._gate: asyncio.Event | None = None
        self._failing_releases = 0
        # What happened, for the test to check (threading events: the test runs on another thread).
        self.abandoned = threading.Event()          # a stalled call was cancelled by the coordinator
        self.lost: list[Hashable] = []              # sequences the target was made to drop
        self.readmitting = threading.Event()        # a lost sequence asked for blocks again
        self.proposer_released: dict[Hashable, threading.Event] = {}
        self.resumes: list[Hashable] = []           # re-prefills of committed tokens
        self.failed_releases: list[Hashable] = []
        self.propose_log: list[tuple[str, int]] = []  # (mode, items) of every propose call

    def __getattr__(self, name: str):  # the calls no fault is armed on (publish, costs, ...) forward as they are
        return getattr(self.inner, name)

    # -- arming ----------------------------------------------------------------------------
    # Counts are from the moment of arming: unarmed, the wrapper only forwards.
    def stall_proposer(self, mode: str, call: int) -> None:
        self._stall[mode] = self._propose_calls.get(mode, 0) + call

    def crash_proposer(self, mode: str, call: int) -> None:
        self._crash[mode] = self._propose_calls.get(mode, 0) + call

    def lose_sequence(self, verify: int, hold_readmission: bool = False) -> None:
        self._lose_at, self._hold_readmission = self._verifies + verify, hold_readmission

    async def open_readmission(self) -> None:
        self._readmission_gate().set()

    def fail_release(self, count: int = 1) -> None:
        self._failing_releases = count

    def watch_proposer_release(self, seq_id: Hashable) -> threading.Event:
        return self.proposer_released.setdefault(seq_id, threading.Event())

    def _readmission_gate(self) -> asyncio.Event:
        if self._gate is None:
            self._gate = asyncio.Event()  # made on the engine's loop, where it is awaited
        return self._gate

    # -- the transport ---------------------------------------------------------------------
    async def admit(self, seq_id: Hashable, tokens: int, avoid: Sequence[str], prefix: Sequence[int] = ()):
        if seq_id in self.lost:
            self.readmitting.set()
            if self._hold_readmission:
                await self._readmission_gate().wait()
        return await self.inner.admit(seq_id, tokens, avoid, prefix)

    async def release(self, seq_id: Hashable, tokens: Sequence[int] | None = None) -> None:
        if self._failing_releases:
            self._failing_releases -= 1
            self.failed_releases.append(seq_id)
            raise ConnectionError("the KV manager did not answer")
        await self.inner.release(seq_id, tokens)

    async def target_step(self, replica, prefills, verifies, releases):
        self.resumes.extend(p.seq_id for p in prefills if p.resume)
        if verifies:
            self._verifies += 1
            if self._verifies == self._lose_at:
                self.lost.append(verifies[0].seq_id)
                self.inner.target.release([verifies[0].seq_id])  # the real worker forgets it
        return await self.inner.target_step(replica, prefills, verifies, releases)

    async def propose(self, mode, replica, items, releases):
        for seq_id in releases:
            if seq_id in self.proposer_released:
                self.proposer_released[seq_id].set()
        self.propose_log.append((mode, len(items)))
        calls = self._propose_calls[mode] = self._propose_calls.get(mode, 0) + (1 if items else 0)
        if items and self._stall.get(mode) == calls:
            try:
                await asyncio.Event().wait()  # hangs until the coordinator gives up on it
            except asyncio.CancelledError:
                self.abandoned.set()
                raise
        if items and self._crash.get(mode) == calls:
            raise ConnectionError(f"proposer replica for {mode} died")
        return await self.inner.propose(mode, replica, items, releases)

    async def forget_target(self, replica: str) -> None:
        await self.inner.forget_target(replica)


@pytest.fixture(scope="module")
def engine() -> Engine:
    """The whole bundle; a proposer is abandoned after 1 s and retried at once."""
    config = CPU_CONFIG.model_copy(update={"scheduler": SchedulerConfig(
        proposer_timeout_s=PROPOSER_TIMEOUT_S, proposer_backoff_s=0.0)})
    with Engine(MODELS, config) as engine:
        yield engine


@pytest.fixture
def faulty(engine):
    """A fresh ``FaultyTransport`` between the engine's coordinator and its workers."""
    real = engine.coordinator.transport
    assert engine.drain()
    engine.metrics.faults.clear()
    engine.coordinator.transport = wrapper = FaultyTransport(real)
    yield wrapper
    engine.coordinator.transport = real


@pytest.mark.parametrize("fault, counted", [("stall", "proposer_timeout"), ("crash", "proposer_failed")])
def test_a_hung_or_crashed_proposer_costs_drafts_never_tokens(fault, counted, engine, faulty, heldout_prompts, caplog):
    """The third eagle3 call hangs (or raises): that round goes without drafts, the fault
    is logged and counted once, the next rounds draft again, and the outputs -- of the
    eagle3 request and of a draft-model request in the same batch -- are the clean ones."""
    jobs = [(heldout_prompts[3], GenerationOptions(max_new_tokens=40, ignore_eos=True, speculative_mode="eagle3")),
            (heldout_prompts[4], GenerationOptions(max_new_tokens=40, ignore_eos=True,
                                                   speculative_mode="draft_model"))]
    clean = [engine.generate(*job) for job in jobs]  # through the wrapper, unarmed
    start = len(faulty.propose_log)
    (faulty.stall_proposer if fault == "stall" else faulty.crash_proposer)("eagle3", call=3)
    with caplog.at_level(logging.WARNING, logger="specserve.coordinator"):
        results = generate_concurrently(engine, jobs)
    assert [r.token_ids for r in results] == [c.token_ids for c in clean]
    assert engine.metrics.faults == {counted: 1}
    assert "proposer eagle3 (replica local) failed" in caplog.text
    assert faulty.abandoned.is_set() == (fault == "stall")
    eagle_calls = [n for mode, n in faulty.propose_log[start:] if mode == "eagle3" and n]
    assert len(eagle_calls) > 3 and results[0].speculative.accepted_tokens > 0  # it drafted again after ...
    # ... and the draft-model request's rounds were not touched at all.
    assert results[1].speculative.accepted_per_position == clean[1].speculative.accepted_per_position
    assert_everything_released(engine)


def test_a_request_cancelled_while_it_is_re_admitted_gives_everything_back(engine, faulty, heldout_prompts):
    """The target loses a sequence; while its re-admission waits for the KV manager, the
    client goes away. The grant that arrives afterwards is given straight back, and a
    request served meanwhile and one served afterwards are both exact."""
    doomed_options = GenerationOptions(max_new_tokens=60, ignore_eos=True, speculative_mode="eagle3")
    survivor_job = (heldout_prompts[6], GenerationOptions(max_new_tokens=30, ignore_eos=True,
                                                          speculative_mode="mtp"))
    clean_doomed = engine.generate(heldout_prompts[5], doomed_options).token_ids
    clean_survivor = engine.generate(*survivor_job).token_ids

    loop = engine._event_loop()
    driver = engine.factory.create("doomed", engine.factory.encode(heldout_prompts[5]), doomed_options)
    faulty.lose_sequence(verify=3, hold_readmission=True)  # the doomed request runs alone until then
    retired = faulty.watch_proposer_release("doomed")
    request = asyncio.run_coroutine_threadsafe(engine.coordinator.run(driver), loop)
    assert faulty.readmitting.wait(30) and faulty.lost == ["doomed"]
    committed = list(driver.state.generated)
    assert 2 <= len(committed) < 60 and committed == clean_doomed[: len(committed)]
    survivor = generate_concurrently(engine, [survivor_job])  # served while the doomed one waits
    request.cancel()                                 # the client goes away mid re-admission
    assert retired.wait(30), "the cancelled request was never retired"
    asyncio.run_coroutine_threadsafe(faulty.open_readmission(), loop).result(10)

    assert request.cancelled() and not driver.finished and driver.state.generated == committed
    assert survivor[0].token_ids == clean_survivor
    assert faulty.resumes == []  # it was never re-prefilled: its new grant went straight back
    assert_everything_released(engine)
    assert engine.metrics.faults == {"target_lost": 1}  # the lost sequence, counted once
    assert engine.generate(heldout_prompts[5], doomed_options).token_ids == clean_doomed


def test_a_failed_ledger_release_is_logged_counted_and_leaks_only_its_own_blocks(engine, faulty, heldout_prompts,
                                                                                  caplog):
    """The first release to the ledger is lost. Nobody else notices: outputs are exact, the
    target's pages all come back, and the ledger keeps exactly that request's blocks
    reserved -- until it is rebuilt from the pool's live grants, as a restarted KV manager
    rebuilds it."""
    jobs = [(heldout_prompts[7], GenerationOptions(max_new_tokens=12, ignore_eos=True, speculative_mode="none")),
            (heldout_prompts[8], GenerationOptions(max_new_tokens=40, ignore_eos=True,
                                                   speculative_mode="shared_kv"))]
    clean = [engine.generate(*job).token_ids for job in jobs]
    assert engine.drain()
    faulty.fail_release(1)
    with caplog.at_level(logging.WARNING, logger="specserve.coordinator"):
        results = generate_concurrently(engine, jobs)
        assert engine.drain()
    assert [r.token_ids for r in results] == clean
    assert engine.metrics.faults == {"ledger_release_failed": 1}
    (lost,) = faulty.failed_releases
    assert f"releasing the KV blocks of {lost!r} failed" in caplog.text

    cache, admission = engine.target.cache, engine.transport.admission
    assert cache.free_blocks == cache.num_blocks and engine.transport.target.sequences == []
    short = results[0]  # the short request retires first: its release is the one lost
    leaked = -(-(short.prompt_tokens + 12) // cache.block_size)
    usage = admission.usage()  # (cached prefix blocks are free blocks too: evictable)
    assert {key: usage[key] for key in ("replicas", "total_blocks", "sequences", "free_blocks", "reserved_blocks")} == \
        {"replicas": 1, "total_blocks": cache.num_blocks, "sequences": 1, "free_blocks": cache.num_blocks - leaked,
         "reserved_blocks": leaked}
    admission.ledger.register_pool(LOCAL_REPLICA, cache.num_blocks, cache.block_size,
                                   live=engine.transport.target.live_grants())
    assert_everything_released(engine)
    assert engine.generate(*jobs[1]).token_ids == clean[1]
