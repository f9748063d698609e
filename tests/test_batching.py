"""Continuous batching: many sequences share each target pass, and every one of them
gets exactly the output it gets alone."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from engine import Engine, EngineConfig, GenerationOptions, KVCacheCapacityError
from engine.model.cached_decoder import FeedRequest
from engine.spec.rounds import SequenceRounds

from .conftest import CPU_CONFIG, MODELS

MIXED = ["none", "prompt_lookup", "draft_model", "mtp", "eagle3", "shared_kv"]


def generate_concurrently(engine: Engine, jobs) -> list[list[int] | None]:
    """One thread per (prompt, options); returns each job's tokens (None if it never returned)."""
    results: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, engine.generate(*jobs[i]).token_ids))
               for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return [results.get(i) for i in range(len(jobs))]


def test_a_padded_batch_gives_each_sequence_its_own_logits_and_kv(bundle_engine, heldout_prompts):
    target = bundle_engine.target
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


def test_concurrent_requests_are_batched_and_each_matches_its_solo_run(heldout_prompts):
    engine = Engine(MODELS, CPU_CONFIG)
    jobs = [(heldout_prompts[i], GenerationOptions(max_new_tokens=16 + 6 * i, ignore_eos=True,
                                                   speculative_mode=MIXED[i % len(MIXED)]))
            for i in range(8)]
    solo = [engine.generate(p, o).token_ids for p, o in jobs]
    batch_sizes = []
    original = engine.target.feed_batch

    def spy(requests):
        batch_sizes.append(len(requests))
        return original(requests)

    engine.target.feed_batch = spy
    assert generate_concurrently(engine, jobs) == solo
    assert max(batch_sizes) >= 4, f"requests were not batched: {batch_sizes}"
    assert engine.target.cache.used_blocks == 0 and engine.draft.cache.used_blocks == 0


def test_a_small_pool_makes_requests_wait_or_be_preempted_not_fail(heldout_prompts, monkeypatch):
    """14 blocks of 16 tokens: two ~70-token prompts fit, but not once both have grown by
    40 tokens, so the newest is preempted (blocks freed, committed tokens re-prefilled
    later). Every output must still equal its solo run."""
    engine = Engine(MODELS, EngineConfig(device="cpu", kv_num_blocks=14, kv_block_size=16))
    modes = ["none", "draft_model", "eagle3", "shared_kv"]  # preempted heads must get their anchor back
    jobs = [(heldout_prompts[i], GenerationOptions(max_new_tokens=40, ignore_eos=True, speculative_mode=modes[i]))
            for i in range(4)]
    solo = [engine.generate(p, o).token_ids for p, o in jobs]
    preemptions = []
    original_preempt = SequenceRounds.preempt
    monkeypatch.setattr(SequenceRounds, "preempt", lambda self: (preemptions.append(self.seq_id),
                                                                 original_preempt(self)))
    assert generate_concurrently(engine, jobs) == solo
    assert preemptions, "the pool never ran short: this test would prove nothing"
    assert engine.target.cache.used_blocks == 0 and engine.draft.cache.used_blocks == 0
    with pytest.raises(KVCacheCapacityError, match="needs"):
        engine.generate(list(range(10, 10 + 300)), GenerationOptions(max_new_tokens=4))


def test_one_failing_request_does_not_disturb_the_batch(heldout_prompts, monkeypatch):
    engine = Engine(MODELS, CPU_CONFIG.model_copy(update={"speculative": CPU_CONFIG.speculative.model_copy(
        update={"load": ("draft_model",)})}))
    good = GenerationOptions(max_new_tokens=24, ignore_eos=True, speculative_mode="draft_model")
    expected = engine.generate(heldout_prompts[0], good).token_ids

    class Exploding:
        name = "exploding"

        def propose(self, ctx):
            raise RuntimeError("proposer crashed")

        def accept(self, ctx): ...

        def rewind(self, tokens): ...

        def close(self): ...

    monkeypatch.setitem(engine._factories, "prompt_lookup", lambda k: Exploding())
    outcome = {}

    def run(name, options):
        try:
            outcome[name] = engine.generate(heldout_prompts[0], options).token_ids
        except RuntimeError as exc:
            outcome[name] = str(exc)

    threads = [threading.Thread(target=run, args=("good", good)),
               threading.Thread(target=run, args=("bad", good.model_copy(update={"speculative_mode": "prompt_lookup"})))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert outcome == {"good": expected, "bad": "proposer crashed"}
    assert engine.target.cache.used_blocks == 0 and engine.draft.cache.used_blocks == 0


class ClientGone(Exception):
    """What a streaming consumer raises when its client disconnects."""


def test_a_stream_consumer_can_cancel_its_request_and_every_block_comes_back(bundle_engine, heldout_prompts):
    seen = []

    def consumer(event):
        seen.append(event.token_id)
        if len(seen) == 5:
            raise ClientGone()

    with pytest.raises(ClientGone):
        bundle_engine.generate(heldout_prompts[1], GenerationOptions(max_new_tokens=64, speculative_mode="draft_model"),
                               on_token=consumer)
    assert len(seen) == 5
    assert bundle_engine.target.cache.used_blocks == 0 and bundle_engine.draft.cache.used_blocks == 0
    # The engine keeps serving afterwards.
    assert bundle_engine.generate(heldout_prompts[1], GenerationOptions(max_new_tokens=4)).completion_tokens == 4
