"""The one scheduler, in-process: the ``Engine`` is the ``RoundCoordinator`` over a
``LocalTransport``. Concurrent requests share each target pass (and each head's draft
run) and every one gets exactly the output it gets alone; admission reserves a
request's worst case and makes the rest wait -- nothing is preempted; a request that
goes away, or loses its KV, gives every block back."""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from specserve.engine import Engine, EngineConfig, GenerationOptions, SpeculativeConfig
from specserve.engine.errors import InvalidRequestError, ModelLoadError
from specserve.engine.kv.block_ledger import AdmissionError
from specserve.engine.model.cached_decoder import FeedRequest
from specserve.engine.sched.sequence_driver import WINDOW_REFUSAL, DriverFactory
from specserve.engine.speculative.proposers.draft_model import DraftModelProposer
from specserve.engine.speculative.proposers.eagle3 import Eagle3Proposer
from specserve.engine.speculative.proposers.mtp import MtpProposer
from specserve.engine.speculative.proposers.shared_kv import SharedKvProposer

from .conftest import CPU_CONFIG, MODELS, PINNED, TARGET_DIR, assert_everything_released, generate_concurrently

MIXED = ["none", "prompt_lookup", "suffix", "draft_model", "mtp", "eagle3", "shared_kv"]


def call_on_loop(engine: Engine, coroutine, timeout: float = 10.0):
    """Run a coroutine on the engine's loop thread (where its coordinator lives)."""
    return asyncio.run_coroutine_threadsafe(coroutine, engine._event_loop()).result(timeout)


def test_a_padded_batch_gives_each_sequence_its_own_logits_and_kv(bundle_engine, heldout_prompts):
    target = bundle_engine.target
    assert bundle_engine.drain()  # this test borrows the engine's target pool
    prompts = [target.encode_prompt(p)[:n] for p, n in zip(heldout_prompts[:3], (40, 25, 33))]
    news = [[11, 12, 13], [14], [15, 16, 17, 18, 19]]
    singles, batched = [], []
    for tag, collect in (("single", singles), ("batch", batched)):
        ids = [(tag, i) for i in range(3)]
        for seq_id, prompt in zip(ids, prompts):
            target.cache.add_sequence(seq_id)
            target.feed(seq_id, prompt, 0)
        requests = [FeedRequest(seq_id, new, len(prompt)) for seq_id, new, prompt in zip(ids, news, prompts)]
        outs = [target.feed(r.seq_id, r.tokens, r.first_position) for r in requests] if tag == "single" \
            else target.feed_batch(requests)
        collect.extend((out, target.cache.materialize(seq_id)) for out, seq_id in zip(outs, ids))
        for seq_id in ids:
            target.cache.free(seq_id)
    for (one, kv_one), (many, kv_many) in zip(singles, batched):
        assert one.logits.shape == many.logits.shape
        np.testing.assert_allclose(one.logits, many.logits, atol=1e-4)
        assert (one.logits.argmax(-1) == many.logits.argmax(-1)).all()
        np.testing.assert_allclose(one.extras["hidden_states"], many.extras["hidden_states"], atol=1e-4)
        for (k1, v1), (k2, v2) in zip(kv_one, kv_many):
            np.testing.assert_allclose(k1, k2, atol=1e-5)
            np.testing.assert_allclose(v1, v2, atol=1e-5)


def test_concurrent_requests_are_batched_and_each_matches_its_solo_run(heldout_prompts, monkeypatch, make_engine):
    """Two requests of every mode: the target verifies them in shared passes, each
    head and the draft model draft for their sequences in one run per step, and each
    output equals its solo run."""
    engine = make_engine(MODELS, CPU_CONFIG)
    jobs = [(heldout_prompts[i], GenerationOptions(max_new_tokens=16 + 4 * i, ignore_eos=True,
                                                   speculative_mode=MIXED[i % len(MIXED)]))
            for i in range(2 * len(MIXED))]
    solo = [engine.generate(p, o).token_ids for p, o in jobs]
    target_batches, head_batches = [], {"draft_model": [], "mtp": [], "eagle3": [], "shared_kv": []}
    original = engine.target.feed_batch

    def spy(requests):
        target_batches.append(len(requests))
        return original(requests)

    monkeypatch.setattr(engine.target, "feed_batch", spy)
    for kind in (DraftModelProposer, MtpProposer, Eagle3Proposer, SharedKvProposer):
        def batch_spy(self, contexts, owners=None, _real=kind.propose_batch):
            head_batches[self.name].append(len(contexts))
            return _real(self, contexts, owners)
        monkeypatch.setattr(kind, "propose_batch", batch_spy)
    rounds_before = engine.coordinator.timings.rounds
    results = generate_concurrently(engine, jobs)
    assert [r.token_ids for r in results] == solo
    assert max(target_batches) >= 4, f"requests were not batched: {target_batches}"
    assert all(max(sizes) == 2 for sizes in head_batches.values()), head_batches  # both sequences, one run
    for result, (_, options) in zip(results, jobs):
        if options.speculative_mode not in ("none", "prompt_lookup"):  # the model-based drafters really drafted
            assert result.speculative.accepted_tokens > 0, options.speculative_mode
    # Every round of every request went through the one coordinator: a prefill plus its verify rounds.
    assert engine.coordinator.timings.rounds - rounds_before == sum(1 + r.speculative.verification_steps
                                                                     for r in results)
    assert_everything_released(engine)


def test_a_request_that_arrives_mid_stream_joins_the_running_batch(target_engine, heldout_prompts, monkeypatch):
    """Continuous batching: a short request submitted while a long one decodes is admitted
    at the next tick, shares its target passes and finishes first -- it does not wait for
    the long one to end."""
    short_options = GenerationOptions(max_new_tokens=8, ignore_eos=True)
    alone = target_engine.generate(heldout_prompts[6], short_options).token_ids
    long_started, finished, batches = threading.Event(), [], []
    real_feed = target_engine.target.feed_batch

    def feed_batch(requests):
        batches.append(len(requests))
        return real_feed(requests)

    monkeypatch.setattr(target_engine.target, "feed_batch", feed_batch)

    def long_request():
        target_engine.generate(heldout_prompts[5], GenerationOptions(max_new_tokens=300, ignore_eos=True),
                               on_token=lambda event: long_started.set())
        finished.append("long")

    long_thread = threading.Thread(target=long_request)
    long_thread.start()
    assert long_started.wait(30)
    short = target_engine.generate(heldout_prompts[6], short_options)
    finished.append("short")
    long_thread.join(120)
    assert finished == ["short", "long"] and short.token_ids == alone
    assert max(batches) == 2


def test_a_small_pool_makes_requests_wait_for_room_not_fail(heldout_prompts, monkeypatch, make_engine):
    """20 blocks of 16 tokens; each request reserves its worst case (prompt + 40 tokens:
    8 to 10 blocks), so at most two run at once and the others wait for room. Nothing is
    preempted, and every output equals its solo run. (The four requests queue behind a
    reservation held until all of them wait, so they really compete for the pool.)"""
    engine = make_engine(MODELS, EngineConfig(device="cpu", speculative=PINNED, kv_num_blocks=20, kv_block_size=16))
    modes = ["none", "draft_model", "eagle3", "shared_kv"]
    jobs = [(heldout_prompts[i], GenerationOptions(max_new_tokens=40, ignore_eos=True, speculative_mode=modes[i]))
            for i in range(4)]
    solo = [engine.generate(p, o).token_ids for p, o in jobs]
    assert engine.drain()
    ledger = engine.transport.admission.ledger
    refused, running = [], []
    all_waiting = threading.Event()
    real_try_admit, real_feed = ledger.try_admit, engine.target.feed_batch

    def try_admit(seq_id, tokens, avoid=(), prefix=()):
        grant = real_try_admit(seq_id, tokens, avoid, prefix)
        if grant is None:
            refused.append(seq_id)
            if len(set(refused)) == len(jobs):
                all_waiting.set()
        return grant

    def feed_batch(requests):
        running.append(len(engine.target.cache.sequences()))
        return real_feed(requests)

    monkeypatch.setattr(ledger, "try_admit", try_admit)
    monkeypatch.setattr(engine.target, "feed_batch", feed_batch)
    call_on_loop(engine, engine.transport.admit("holder", 20 * 16, []))
    results: list = []
    submitter = threading.Thread(target=lambda: results.extend(generate_concurrently(engine, jobs)))
    submitter.start()
    assert all_waiting.wait(30), "the requests never queued for room"
    queued = len(refused)
    call_on_loop(engine, engine.transport.release("holder"))
    submitter.join(300)
    assert [r.token_ids for r in results] == solo
    assert len(refused) > queued  # after the release, two fit and the others went on waiting
    assert max(running) == 2  # two at once fit, three never
    assert_everything_released(engine)
    with pytest.raises(AdmissionError, match="needs more KV than any"):  # could never fit: refused at once
        engine.generate(list(range(10, 10 + 300)), GenerationOptions(max_new_tokens=40))


def test_admission_waits_for_room_up_to_its_timeout(heldout_prompts, monkeypatch, make_engine):
    """Another holder keeps 8 of 12 blocks; a request needing 5 waits. With a short
    timeout it fails (AdmissionError, nothing leaked); with the default it is admitted
    the moment the blocks come back, and its output is the one it gets alone."""
    engine = make_engine(TARGET_DIR, EngineConfig(device="cpu", speculative=PINNED, kv_num_blocks=12, kv_block_size=16))
    prompt = engine.tokenizer.encode(heldout_prompts[13])[:50]
    options = GenerationOptions(max_new_tokens=30, ignore_eos=True)  # 80 tokens: 5 blocks
    alone = engine.generate(prompt, options).token_ids
    assert engine.drain()
    call_on_loop(engine, engine.transport.admit("holder", 8 * 16, []))
    admission = engine.transport.admission
    monkeypatch.setattr(admission, "timeout_s", 0.2)
    with pytest.raises(AdmissionError, match="after waiting 0.2 s .4 of 12 blocks free"):
        engine.generate(prompt, options)
    assert admission.usage()["sequences"] == 1 and engine.target.cache.used_blocks == 0
    monkeypatch.setattr(admission, "timeout_s", 30.0)

    waiting = threading.Event()
    real_try_admit = admission.ledger.try_admit

    def try_admit(seq_id, tokens, avoid=(), prefix=()):
        grant = real_try_admit(seq_id, tokens, avoid, prefix)
        if grant is None:
            waiting.set()
        return grant

    monkeypatch.setattr(admission.ledger, "try_admit", try_admit)
    admitted: list = []
    worker = threading.Thread(target=lambda: admitted.append(engine.generate(prompt, options)))
    worker.start()
    assert waiting.wait(10), "the request never had to wait"
    assert engine.target.cache.used_blocks == 0  # it waits without touching the pool
    call_on_loop(engine, engine.transport.release("holder"))
    worker.join(60)
    assert [r.token_ids for r in admitted] == [alone]
    assert_everything_released(engine)


class ClientGone(Exception):
    """What a streaming consumer raises when its client disconnects."""


def test_a_stream_consumer_can_cancel_its_request_and_every_block_comes_back(bundle_engine, heldout_prompts):
    survivor_options = GenerationOptions(max_new_tokens=40, ignore_eos=True, speculative_mode="eagle3")
    expected = bundle_engine.generate(heldout_prompts[0], survivor_options).token_ids
    survivor_started, seen = threading.Event(), []

    def consumer(event):
        seen.append(event.token_id)
        if len(seen) == 5:
            raise ClientGone()

    def start_doomed():
        assert survivor_started.wait(30)
        return bundle_engine.generate(heldout_prompts[1], GenerationOptions(
            max_new_tokens=64, speculative_mode="draft_model"), on_token=consumer)

    results: dict[str, object] = {}

    def run(name, call):
        try:
            results[name] = call()
        except Exception as exc:  # noqa: BLE001
            results[name] = exc

    threads = [threading.Thread(target=run, args=("survivor", lambda: bundle_engine.generate(
                   heldout_prompts[0], survivor_options, on_token=lambda e: survivor_started.set()))),
               threading.Thread(target=run, args=("doomed", start_doomed))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert isinstance(results["doomed"], ClientGone) and len(seen) == 5
    assert results["survivor"].token_ids == expected
    assert_everything_released(bundle_engine)
    # The engine keeps serving afterwards.
    assert bundle_engine.generate(heldout_prompts[1], GenerationOptions(max_new_tokens=4)).completion_tokens == 4


def test_a_target_that_loses_a_sequence_gets_it_re_prefilled_without_losing_tokens(bundle_engine, heldout_prompts,
                                                                                     monkeypatch):
    """The target worker forgets the sequence mid-stream (what a replacement replica looks
    like): the coordinator re-admits it, re-prefills the committed tokens once, and the
    output is unchanged -- nothing lost, nothing duplicated."""
    options = GenerationOptions(max_new_tokens=30, ignore_eos=True, speculative_mode="mtp")
    expected = bundle_engine.generate(heldout_prompts[2], options).token_ids
    worker = bundle_engine.transport.target
    resumes, committed = [], []
    real_step = worker.step

    def step(prefills=(), verifies=(), releases=()):
        resumes.extend(len(p.tokens) for p in prefills if p.resume)
        return real_step(prefills, verifies, releases)

    def forget_after_six(event):  # runs on the loop thread, between two target passes
        committed.append(event.token_id)
        if len(committed) >= 6 and not resumes and worker.sequences:
            worker.release(worker.sequences)

    monkeypatch.setattr(worker, "step", step)
    result = bundle_engine.generate(heldout_prompts[2], options, on_token=forget_after_six)
    assert result.token_ids == expected
    prompt_len = len(bundle_engine.factory.encode(heldout_prompts[2]))
    assert len(resumes) == 1 and 6 <= resumes[0] - prompt_len < 30  # every committed token, once
    assert_everything_released(bundle_engine)


def test_modes_defaults_and_reservations_are_decided_in_one_place(bundle_engine):
    """The ``DriverFactory`` the engine and the server's router share: which modes are
    served, what ``default_mode="auto"`` picks, the sliding-window refusal, and how much
    KV a request reserves."""
    f = bundle_engine.factory

    def factory(served, **config) -> DriverFactory:
        return DriverFactory(f.tokenizer, f.eos_token_ids, f.max_context, f.vocab_size,
                             CPU_CONFIG.model_copy(update=config), {m: bundle_engine.needs[m] for m in served})

    only_eagle = factory(["eagle3"])
    assert only_eagle.modes == ["none", "prompt_lookup", "suffix", "eagle3"] and only_eagle.default_mode == "eagle3"
    with pytest.raises(InvalidRequestError, match="'mtp' is not loaded.*available: none, prompt_lookup, suffix, eagle3"):
        only_eagle.create("x", [1, 2, 3], GenerationOptions(speculative_mode="mtp"))
    assert factory([]).default_mode == "none"
    assert factory(["draft_model", "shared_kv"]).default_mode == "shared_kv"
    assert factory(["draft_model", "mtp", "eagle3", "shared_kv"]).default_mode == "eagle3"
    with pytest.raises(ModelLoadError, match="'mtp' is not available"):
        factory(["eagle3"], speculative=SpeculativeConfig(default_mode="mtp", adaptive=False))

    driver = only_eagle.create("y", [1, 2, 3], GenerationOptions(max_new_tokens=600))
    assert driver.mode == "eagle3" and driver.kv_tokens == f.max_context == 512  # capped at the context
    assert only_eagle.create("z", [1, 2, 3], GenerationOptions(max_new_tokens=20)).kv_tokens == 23

    windowed = factory(["eagle3"], sliding_window=64, sink_tokens=4)
    assert windowed.default_mode == "none"
    assert windowed.create("w", [1, 2, 3], GenerationOptions(max_new_tokens=600)).kv_tokens == 6 * 16
    with pytest.raises(InvalidRequestError, match="full-attention KV cache"):
        windowed.create("v", [1, 2, 3], GenerationOptions(speculative_mode="prompt_lookup"))
    with pytest.raises(ModelLoadError, match="full-attention KV cache"):
        factory(["eagle3"], sliding_window=64, speculative=SpeculativeConfig(default_mode="eagle3", adaptive=False))
    assert "full-attention" in WINDOW_REFUSAL


def _plain_steps_config(steps: int, load=()) -> EngineConfig:
    return CPU_CONFIG.model_copy(update={"scheduler": CPU_CONFIG.scheduler.model_copy(update={"plain_steps": steps}),
                                         "speculative": SpeculativeConfig(load=load, adaptive=False)})


def test_target_only_rounds_run_several_to_a_call_and_give_the_same_tokens(heldout_prompts, make_engine):
    """``plain_steps``: a target-only sequence's target call runs up to that many rounds,
    each feeding the token the last chose. Whatever ends a request -- its budget, a stop
    string, end of sequence, the context -- and however it samples, every token, logprob
    and finish reason is what one round per call gives, and every block comes back."""
    one, four = make_engine(TARGET_DIR, _plain_steps_config(1)), make_engine(TARGET_DIR, _plain_steps_config(4))
    near_the_end = list(range(5, 5 + one.target.max_context - 6))  # room for 6 tokens only
    # The bundled model never ends a text by itself: declare the 6th token it writes
    # after prompt 1 its end-of-sequence token, so that request ends mid-call.
    end = one.generate(heldout_prompts[1], GenerationOptions(max_new_tokens=8, ignore_eos=True)).token_ids[5]
    for engine in (one, four):
        engine.target.eos_token_ids = engine.factory.eos_token_ids = (end,)
    jobs = [(heldout_prompts[0], GenerationOptions(max_new_tokens=13, ignore_eos=True)),
            (heldout_prompts[1], GenerationOptions(max_new_tokens=40)),
            (heldout_prompts[2], GenerationOptions(max_new_tokens=30, stop=["e"])),
            (heldout_prompts[3], GenerationOptions(max_new_tokens=37, temperature=0.9, seed=11, logprobs=True,
                                                   top_logprobs=2)),
            (near_the_end, GenerationOptions(max_new_tokens=20, ignore_eos=True))]

    def outputs(engine):
        results = generate_concurrently(engine, jobs)
        return ([(r.token_ids, r.text, r.finish_reason, [lp.token for lp in r.logprobs or ()]) for r in results],
                [lp.logprob for r in results for lp in r.logprobs or ()])

    expected, expected_logprobs = outputs(one)
    assert {e[2] for e in expected} >= {"length", "stop"}  # the cases really end differently
    assert expected[1][2] == "stop" and expected[1][0][-1] == end and len(expected[1][0]) == 6
    got, logprobs = outputs(four)
    assert got == expected
    # batches of other shapes round differently in the last bits
    assert logprobs == pytest.approx(expected_logprobs, abs=1e-4) and len(logprobs) == 37

    calls: list[list[int]] = []
    real = four.transport.target_step

    async def target_step(replica, prefills, verifies, releases):
        if verifies:
            calls.append([item.steps for item in verifies])
        return await real(replica, prefills, verifies, releases)

    four.transport.target_step = target_step
    result = four.generate(*jobs[0])
    assert result.speculative.verification_steps == 12  # 13 tokens: the prefill's, then 12 rounds
    assert calls == [[4], [4], [4]]  # in three target calls
    assert_everything_released(four)


def test_a_call_with_a_drafting_sequence_runs_one_round_each(heldout_prompts, make_engine, monkeypatch):
    """Several plain rounds per call only where every sequence in it is target-only: a
    drafting sequence must not wait for another's extra rounds."""
    engine = make_engine(MODELS, _plain_steps_config(4, load=("eagle3",)))
    steps: list[tuple[str, ...]] = []
    real = engine.transport.target_step

    async def target_step(replica, prefills, verifies, releases):
        if verifies:
            steps.append(tuple(sorted(f"{item.steps}{'d' if item.drafts else ''}" for item in verifies)))
        return await real(replica, prefills, verifies, releases)

    monkeypatch.setattr(engine.transport, "target_step", target_step)
    jobs = [(heldout_prompts[4], GenerationOptions(max_new_tokens=24, ignore_eos=True, speculative_mode=mode))
            for mode in ("none", "eagle3")]
    solo = [engine.generate(*job).token_ids for job in jobs]
    steps.clear()
    assert [r.token_ids for r in generate_concurrently(engine, jobs)] == solo
    together = [s for s in steps if len(s) == 2]
    assert together and all(s in (("1", "1d"), ("1", "1")) for s in together), together
    assert ("4",) in steps  # alone, the target-only sequence ran four rounds a call
    assert_everything_released(engine)
