"""The distributed round algorithm (coordinator + target worker + proposer workers +
block ledger) run in one process through ``LocalTransport``: greedy output must be
token-identical to the in-process engine for every mode, with the batch mixing modes,
and every reserved block must come back."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engine import GenerationOptions
from engine.kv.block_ledger import AdmissionError, BlockLedger
from engine.model.cached_decoder import CachedDecoder
from engine.sched.coordinator import RoundCoordinator
from engine.errors import InvalidRequestError
from engine.sched.local_transport import LocalTransport
from engine.spec.proposers.registry import load_proposer_factory
from engine.sched.proposer_worker import ProposerWorker
from engine.spec.proposers.base import Needs
from engine.sched.sequence_driver import DriverFactory
from engine.sched.target_worker import TargetWorker

from .conftest import CPU_CONFIG, MODELS

MODES = ("none", "prompt_lookup", "draft_model", "mtp", "eagle3", "shared_kv")


@pytest.fixture(scope="module")
def split(bundle_engine):
    """A target worker with its own decoder, and one proposer worker per model-based mode."""
    target = TargetWorker(CachedDecoder(MODELS / "target", CPU_CONFIG))
    proposers = {kind: ProposerWorker(load_proposer_factory(kind, bundle_engine.bundle_dir, bundle_engine.manifest,
                                                            CPU_CONFIG, target.target.decoder.vocab_size))
                 for kind in ("draft_model", "mtp", "eagle3", "shared_kv")}
    transport = LocalTransport(target, proposers)
    factory = DriverFactory(target.target.tokenizer, target.target.eos_token_ids, target.target.max_context,
                            target.target.decoder.vocab_size, CPU_CONFIG.speculative,
                            {**bundle_engine.needs, "draft_model": Needs()})
    return transport, factory


async def _generate(coordinator, factory, requests, drain=True):
    async def one(i, prompt, options):
        driver, kv_tokens = factory.create(f"r{i}", factory.encode(prompt), options)
        await coordinator.run(driver, kv_tokens)
        return driver
    drivers = await asyncio.gather(*(one(i, p, o) for i, (p, o) in enumerate(requests)))
    if drain:
        await coordinator.drain()
    return drivers


def test_mixed_mode_batches_match_the_in_process_engine_token_for_token(split, bundle_engine, heldout_prompts):
    transport, factory = split
    requests = [(prompt, GenerationOptions(max_new_tokens=24, speculative_mode=MODES[i % len(MODES)]))
                for i, prompt in enumerate(heldout_prompts[:12])]
    coordinator = RoundCoordinator(transport, lanes=2)
    drivers = asyncio.run(_generate(coordinator, factory, requests))
    for driver, (prompt, options) in zip(drivers, requests):
        expected = bundle_engine.generate(prompt, options)
        assert driver.state.generated == expected.token_ids, driver.mode
        assert driver.state.text == expected.text
        if driver.mode not in ("none", "prompt_lookup"):  # the model-based drafters really speculated
            assert driver.stats.accepted_tokens > 0, driver.mode
    assert coordinator.timings.ticks > 0
    assert transport.ledger.usage()["free_blocks"] == transport.ledger.usage()["total_blocks"]
    assert transport.target.sequences == [] and transport.target.target.cache.free_blocks == \
        transport.target.target.cache.num_blocks
    assert all(not worker.sequences for worker in transport.proposers.values())


def test_a_cancelled_request_frees_its_blocks_and_leaves_the_others_exact(split, bundle_engine, heldout_prompts):
    transport, factory = split
    coordinator = RoundCoordinator(transport, lanes=1)
    options = GenerationOptions(max_new_tokens=40, speculative_mode="eagle3")

    async def scenario():
        survivor = asyncio.ensure_future(_generate(coordinator, factory, [(heldout_prompts[0], options)]))
        driver, kv_tokens = factory.create("doomed", factory.encode(heldout_prompts[1]), options)
        doomed = asyncio.ensure_future(coordinator.run(driver, kv_tokens))
        while len(driver.state.generated) < 5:
            await asyncio.sleep(0.001)
        doomed.cancel()
        (kept,) = await survivor
        await coordinator.drain()
        return kept, driver

    kept, cancelled = asyncio.run(scenario())
    assert kept.state.generated == bundle_engine.generate(heldout_prompts[0], options).token_ids
    assert not cancelled.finished
    assert transport.ledger.usage()["free_blocks"] == transport.ledger.usage()["total_blocks"]
    assert transport.target.target.cache.free_blocks == transport.target.target.cache.num_blocks


def test_a_target_that_loses_a_sequence_gets_it_re_prefilled_without_losing_tokens(split, bundle_engine,
                                                                                     heldout_prompts):
    """The target forgets the sequence mid-stream (what a replacement replica looks like):
    the coordinator re-admits it, re-prefills the committed tokens and the output is
    unchanged -- nothing lost, nothing duplicated."""
    transport, factory = split
    coordinator = RoundCoordinator(transport, lanes=1)
    options = GenerationOptions(max_new_tokens=30, speculative_mode="mtp")

    async def scenario():
        driver, kv_tokens = factory.create("moved", factory.encode(heldout_prompts[2]), options)
        task = asyncio.ensure_future(coordinator.run(driver, kv_tokens))
        while len(driver.state.generated) < 6:
            await asyncio.sleep(0.001)
        transport.target.release(["moved"])  # its KV is gone; the ledger still knows the tokens
        await task
        await coordinator.drain()
        return driver

    driver = asyncio.run(scenario())
    assert driver.state.generated == bundle_engine.generate(heldout_prompts[2], options).token_ids
    assert transport.ledger.usage()["free_blocks"] == transport.ledger.usage()["total_blocks"]


def test_the_ledger_reserves_whole_requests_on_the_roomiest_pool_and_refuses_what_never_fits():
    ledger = BlockLedger()
    ledger.register_pool("a", num_blocks=4, block_size=16)
    ledger.register_pool("b", num_blocks=8, block_size=16)
    first = ledger.try_admit("s1", 40)               # 3 blocks, on the larger pool
    assert first.replica == "b" and len(first.blocks) == 3
    assert ledger.try_admit("s2", 64).replica == "b"  # b still has 5 free, a has 4
    assert ledger.try_admit("s3", 64).replica == "a"
    assert ledger.try_admit("s4", 40) is None         # 1 + 0 free: wait
    with pytest.raises(AdmissionError, match="more KV than any"):
        ledger.try_admit("huge", 16 * 9)
    ledger.record([("s1", 17, [5, 6])])
    assert ledger.block_table("s1") == first.blocks[:2] and ledger.committed_tokens("s1") == [5, 6]
    for seq in ("s1", "s2", "s3"):
        assert ledger.release(seq)
    assert ledger.usage()["free_blocks"] == 12 and not ledger.release("s1")
    assert np.array_equal(sorted(ledger._pools["b"].free), np.arange(8))


def test_a_mode_the_server_did_not_deploy_is_refused_by_name(split):
    _, factory = split
    only_eagle = DriverFactory(factory.tokenizer, factory.eos_token_ids, factory.max_context, factory.vocab_size,
                               factory.speculative, {"eagle3": factory.remote_needs["eagle3"]})
    assert only_eagle.modes == ["none", "prompt_lookup", "eagle3"]
    with pytest.raises(InvalidRequestError, match="'mtp' is not loaded.*available: none, prompt_lookup, eagle3"):
        only_eagle.create("x", [1, 2, 3], GenerationOptions(speculative_mode="mtp"))
    driver, kv_tokens = only_eagle.create("y", [1, 2, 3], GenerationOptions(max_new_tokens=600))
    assert driver.mode == "none" and kv_tokens == factory.max_context  # the default mode; KV capped at the context
