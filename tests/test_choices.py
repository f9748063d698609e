"""A request's several choices (``n``, batched prompts) are admitted whole or not at all:
the router's ``admit_all`` on the in-process engine's real coordinator and KV ledger."""
from __future__ import annotations

import asyncio
import time

import pytest

from deployments.router import admit_all
from engine import Engine, EngineConfig, GenerationOptions, SpeculativeConfig
from engine.config import SchedulerConfig
from engine.kv.block_ledger import AdmissionError

from .conftest import ROOT

BLOCK = 16


@pytest.fixture(scope="module")
def small_pool():
    """64 KV blocks of 16 tokens; a 400-token request reserves 26 of them."""
    config = EngineConfig(device="cpu", intra_op_threads=1, kv_num_blocks=64, kv_block_size=BLOCK,
                          speculative=SpeculativeConfig(load=(), adaptive=False),
                          scheduler=SchedulerConfig(admission_timeout_s=30.0))
    with Engine(ROOT / "models/target", config) as engine:
        yield engine


def _on_engine_loop(engine: Engine, coroutine):
    return asyncio.run_coroutine_threadsafe(coroutine, engine._event_loop()).result(timeout=60)


def _choices(engine: Engine, name: str, n: int) -> list:
    ids = engine.factory.encode("def main():")
    options = GenerationOptions(max_new_tokens=400, ignore_eos=True, speculative_mode="none")
    return [engine.factory.create(f"{name}{i}", ids, options) for i in range(n)]


async def _settle(engine: Engine, sequences: int, timeout_s: float = 20.0) -> dict:
    """The ledger once it holds ``sequences`` (retired choices leave at the next tick)."""
    deadline = time.monotonic() + timeout_s
    while (usage := engine.transport.admission.usage())["sequences"] != sequences and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return usage


def test_a_request_cancelled_while_a_choice_waits_for_kv_frees_the_admitted_ones(small_pool):
    async def scenario():
        await small_pool.transport.admission.admit("hog", 30 * BLOCK)  # 34 blocks left: one choice fits
        drivers, rejected = _choices(small_pool, "cancelled", 2), []
        admitting = asyncio.ensure_future(admit_all(small_pool.coordinator, drivers,
                                                   lambda d, outcome: rejected.append((d, outcome))))
        waiting = await _settle(small_pool, 2)  # the hog and the first choice; the second waits
        admitting.cancel()  # the client leaves
        with pytest.raises(asyncio.CancelledError):
            await admitting
        after = await _settle(small_pool, 1)
        await small_pool.transport.admission.release("hog")
        return waiting, after, rejected, drivers

    waiting, after, rejected, drivers = _on_engine_loop(small_pool, scenario())
    assert waiting["sequences"] == 2 and waiting["free_blocks"] == 64 - 30 - 26
    assert after["sequences"] == 1 and after["free_blocks"] == 64 - 30  # the admitted choice was retired
    assert rejected == [(d, "cancelled") for d in drivers] and not drivers[0].finished  # never decoded to its end


def test_a_choice_that_cannot_be_admitted_takes_its_siblings_with_it(small_pool):
    async def scenario():
        await small_pool.transport.admission.admit("hog", 30 * BLOCK)
        drivers, rejected = _choices(small_pool, "refused", 2), []
        small_pool.transport.admission.timeout_s = 0.3  # the first choice still decodes when the second gives up
        with pytest.raises(AdmissionError):
            await admit_all(small_pool.coordinator, drivers, lambda d, outcome: rejected.append((d, outcome)))
        small_pool.transport.admission.timeout_s = 30.0
        after = await _settle(small_pool, 1)
        await small_pool.transport.admission.release("hog")
        whole = await admit_all(small_pool.coordinator, _choices(small_pool, "whole", 2),
                                lambda d, outcome: rejected.append((d, outcome)))
        for run in whole:
            await small_pool.coordinator.follow(run)
        return after, rejected, drivers, whole

    after, rejected, drivers, whole = _on_engine_loop(small_pool, scenario())
    assert after["sequences"] == 1 and after["free_blocks"] == 64 - 30
    assert rejected == [(d, "rejected") for d in drivers]  # both counted, the one admitted and retired too
    assert [len(run.driver.state.generated) for run in whole] == [400, 400]  # with room, both run whole
