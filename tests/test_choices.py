"""A request's several choices (``n``, batched prompts) are admitted whole or not at all:
the ledger reserves their KV together, so a request never holds part of it while it
waits for the rest. The router's ``admit_all`` on the in-process engine's real
coordinator and KV ledger, and the ledger itself."""
from __future__ import annotations

import asyncio
import time

import pytest

from specserve.deployments.choices import admit_all
from specserve.engine import Engine, EngineConfig, GenerationOptions, SpeculativeConfig
from specserve.engine.config import SchedulerConfig
from specserve.engine.kv.block_ledger import AdmissionError, BlockLedger

from .conftest import ROOT

BLOCK = 16


def test_the_ledger_reserves_a_group_whole_or_not_at_all():
    ledger = BlockLedger()
    ledger.register_pool("a", 10, BLOCK)
    ledger.register_pool("b", 10, BLOCK)
    assert ledger.try_admit("holder", 7 * BLOCK) is not None  # pool a: 3 blocks left, pool b: 10
    assert ledger.try_admit_many([("x", 6 * BLOCK), ("y", 6 * BLOCK)]) is None  # room for one only
    assert ledger.usage()["sequences"] == 1 and ledger.usage()["free_blocks"] == 13  # and it took nothing
    grants = ledger.try_admit_many([("x", 6 * BLOCK), ("y", 3 * BLOCK)])
    assert [g.replica for g in grants] == ["b", "b"] and ledger.usage()["free_blocks"] == 4  # each to the roomiest
    with pytest.raises(AdmissionError, match="together need more KV"):
        ledger.try_admit_many([("p", 11 * BLOCK), ("q", 11 * BLOCK)])  # each fits a pool, never both at once
    with pytest.raises(AdmissionError, match="needs more KV than any target replica"):
        ledger.try_admit_many([("p", BLOCK), ("q", 11 * BLOCK)])
    assert ledger.usage()["sequences"] == 3  # the refused groups left nothing behind


@pytest.fixture(scope="module")
def small_pool():
    """64 KV blocks of 16 tokens; a 400-token request reserves 26 of them."""
    config = EngineConfig(device="cpu", intra_op_threads=1, kv_num_blocks=64, kv_block_size=BLOCK,
                          speculative=SpeculativeConfig(load=(), adaptive=False),
                          scheduler=SchedulerConfig(admission_timeout_s=30.0))
    with Engine(ROOT / "models/fixture/target", config) as engine:
        yield engine


def _on_engine_loop(engine: Engine, coroutine):
    return asyncio.run_coroutine_threadsafe(coroutine, engine._event_loop()).result(timeout=60)


def _choices(engine: Engine, name: str, n: int) -> list:
    ids = engine.factory.encode("def main():")
    options = GenerationOptions(max_new_tokens=400, ignore_eos=True, speculative_mode="none")
    return [engine.factory.create(f"{name}{i}", ids, options) for i in range(n)]


def _recorder(rejected: list):
    return lambda driver, outcome: rejected.append((driver, outcome))


def test_choices_that_fit_only_one_at_a_time_wait_holding_nothing_and_a_client_may_leave(small_pool):
    async def scenario():
        admission = small_pool.transport.admission
        await admission.admit("hog", 30 * BLOCK)  # 34 blocks left: room for one choice, not two
        drivers, rejected = _choices(small_pool, "cancelled", 2), []
        admitting = asyncio.ensure_future(admit_all(small_pool.coordinator, drivers, _recorder(rejected)))
        await asyncio.sleep(0.3)
        waiting = admission.usage()
        admitting.cancel()  # the client leaves
        with pytest.raises(asyncio.CancelledError):
            await admitting
        await admission.release("hog")
        return waiting, admission.usage(), rejected, drivers

    waiting, after, rejected, drivers = _on_engine_loop(small_pool, scenario())
    assert waiting["sequences"] == 1 and waiting["free_blocks"] == 64 - 30  # neither choice took a block
    assert after["sequences"] == 0 and after["free_blocks"] == 64
    assert rejected == [(d, "cancelled") for d in drivers] and not any(d.state.generated for d in drivers)


def test_a_group_is_refused_after_the_timeout_or_at_once_if_it_could_never_fit(small_pool):
    async def scenario():
        admission = small_pool.transport.admission
        await admission.admit("hog", 30 * BLOCK)
        admission.timeout_s, rejected = 0.3, []
        drivers = _choices(small_pool, "refused", 2)
        with pytest.raises(AdmissionError, match="after waiting"):
            await admit_all(small_pool.coordinator, drivers, _recorder(rejected))
        admission.timeout_s = 30.0
        held = admission.usage()
        await admission.release("hog")
        started = time.monotonic()
        with pytest.raises(AdmissionError, match="together need more KV"):  # 3 x 26 blocks > 64, pool empty
            await admit_all(small_pool.coordinator, _choices(small_pool, "never", 3), _recorder(rejected))
        refused_in = time.monotonic() - started
        whole = await admit_all(small_pool.coordinator, _choices(small_pool, "whole", 2), _recorder(rejected))
        for run in whole:
            await small_pool.coordinator.follow(run)
        return held, refused_in, rejected, drivers, whole

    held, refused_in, rejected, drivers, whole = _on_engine_loop(small_pool, scenario())
    assert held["sequences"] == 1 and held["free_blocks"] == 64 - 30
    assert rejected[:2] == [(d, "rejected") for d in drivers] and len(rejected) == 5  # the 3 never-fitting too
    assert refused_in < 5.0  # not after the 30 s admission timeout
    assert [len(run.driver.state.generated) for run in whole] == [400, 400]  # with room, both run whole
