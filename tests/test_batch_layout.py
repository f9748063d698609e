"""Batched calls on a kept batch layout (``engine.kv.batch_layout``) give what feeding
each sequence alone gives, through joins, departures, dummy rows, rewinds and rebuilds."""
from __future__ import annotations

import random

import numpy as np
import pytest

from specserve.engine.kv import batch_layout
from specserve.engine.model.cached_decoder import CachedDecoder, FeedRequest
from tests.conftest import CPU_CONFIG, DRAFT_DIR


@pytest.mark.parametrize("fresh_memory", ["as numpy gives it", "NaN"])
def test_batched_calls_on_a_kept_layout_match_feeding_each_sequence_alone(monkeypatch, fresh_memory):
    if fresh_memory == "NaN":  # a rebuilt layout's padding must be zeroed, whatever memory it got
        monkeypatch.setattr(batch_layout, "np", _NanEmptyNumpy())
    batched, alone = CachedDecoder(DRAFT_DIR, CPU_CONFIG), CachedDecoder(DRAFT_DIR, CPU_CONFIG)
    rng = random.Random(7)
    vocab = batched.decoder.vocab_size
    lengths: dict[int, int] = {}
    next_id = 0

    def same(out_a, out_b) -> None:
        np.testing.assert_allclose(out_a.logits, out_b.logits, atol=1e-4)
        assert (out_a.logits.argmax(-1) == out_b.logits.argmax(-1)).all()

    for step in range(90):
        action = rng.random()
        if len(lengths) < 2 or (action < 0.15 and len(lengths) < 7):
            seq, next_id = next_id, next_id + 1
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(3, 40))]
            for decoder in (batched, alone):
                decoder.cache.add_sequence(seq)
            same(batched.feed(seq, prompt, 0), alone.feed(seq, prompt, 0))
            lengths[seq] = len(prompt)
        elif action < 0.25 or max(lengths.values()) > 300:
            seq = max(lengths, key=lengths.get) if max(lengths.values()) > 300 else rng.choice(sorted(lengths))
            for decoder in (batched, alone):
                decoder.cache.free(seq)
            del lengths[seq]
        else:
            # Mostly the same big group each step (as a running batch is), sometimes a
            # subset (a dummy row) or one sequence alone (its copy leaves the layout).
            members = sorted(lengths) if action < 0.75 else rng.sample(sorted(lengths), rng.randrange(1, len(lengths) + 1))
            rng.shuffle(members)
            requests = [FeedRequest(s, [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))], lengths[s])
                        for s in members]
            outs = batched.feed_batch(requests)
            for request, out in zip(requests, outs):
                same(out, alone.feed(request.seq_id, request.tokens, request.first_position))
                kept = lengths[request.seq_id] + rng.randrange(1, len(request.tokens) + 1)  # drafts rejected
                for decoder in (batched, alone):
                    decoder.cache.rewind(request.seq_id, kept)
                lengths[request.seq_id] = kept
    for seq in lengths:
        for (k1, v1), (k2, v2) in zip(batched.cache.materialize(seq), alone.cache.materialize(seq)):
            np.testing.assert_allclose(k1, k2, atol=1e-5)
            np.testing.assert_allclose(v1, v2, atol=1e-5)
    layouts = batched.batch_layouts
    # The schedule really went through every path of the layout.
    assert layouts.reused > 10 and layouts.rebuilt > 3 and layouts.placed > 0 and layouts.dummy_rows > 0, vars(layouts)


class _NanEmptyNumpy:
    """numpy, except that ``empty`` hands out NaN-filled memory (what garbage can be)."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def empty(shape, dtype=float):
        return np.full(shape, np.nan, dtype)
