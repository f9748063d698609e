"""Calibration: the workers time their real models once, at start-up, into the cost
tables adaptive speculation plans with (``sched.cost_tables``).

``measure_verify_costs`` times the target on batches of dummy sequences (1 and 5 rows
each at a few batch sizes, and 2 rows at batch 1) -- which also warms onnxruntime up, so
the first request does not pay for it; ``measure_draft_costs`` times a proposer mode on synthetic contexts.
"""
from __future__ import annotations

import time

import numpy as np

from specserve.engine.model.cached_decoder import CachedDecoder, FeedRequest
from specserve.engine.sched.cost_tables import DraftCostTable, VerifyCostTable

CALIBRATION_BATCHES = (1, 4, 16, 32)
CALIBRATION_ROWS = (1, 5)  # rows per sequence: a plain step, and a verify of 4 drafts
# ... and at batch 1 a verify of 1 draft too. A lone sequence's plain step runs the target's
# step graph where it has one (quantised weights, in place) and any wider call the verify
# graph, so there the cost jumps from 1 row to 2 and then grows slowly: without the middle
# point the table would price 1-3 drafts as a fraction of that jump
# (docs/adaptive-speculation.md). Batched calls run one graph at every width.
LONE_SEQUENCE_ROWS = (1, 2, 5)
CALIBRATION_PAST = 64           # tokens already in each dummy sequence's KV


def measure_verify_costs(target: CachedDecoder, max_batch: int, repeats: int = 2) -> VerifyCostTable:
    """Time real target calls on dummy sequences; the pool must have room and nobody else
    may use it meanwhile (call before the worker takes requests). Leaves the pool empty."""
    cache = target.cache
    per_seq_blocks = -(-(CALIBRATION_PAST + max(CALIBRATION_ROWS)) // cache.block_size)
    fits = max(1, cache.free_blocks // per_seq_blocks)
    batches = [b for b in CALIBRATION_BATCHES if b <= min(max_batch, fits)] or [1]
    seconds: dict[tuple[int, int], float] = {}
    ids = [("calibration", i) for i in range(batches[-1])]
    rng = np.random.default_rng(0)
    vocab = target.decoder.vocab_size
    for seq in ids:
        cache.add_sequence(seq)
    try:
        target.feed_batch([FeedRequest(seq, rng.integers(0, vocab, CALIBRATION_PAST).tolist(), 0) for seq in ids])
        for batch in batches:
            for rows in LONE_SEQUENCE_ROWS if batch == 1 else CALIBRATION_ROWS:
                requests = [FeedRequest(seq, rng.integers(0, vocab, rows).tolist(), CALIBRATION_PAST)
                            for seq in ids[:batch]]
                best = float("inf")
                # The first call of a new shape pays onnxruntime's allocation planning, which
                # no later call pays: warm each shape untimed.
                for attempt in range(repeats + 1):
                    started = time.perf_counter()
                    target.feed_batch(requests)
                    if attempt:
                        best = min(best, time.perf_counter() - started)
                    for seq in ids[:batch]:
                        cache.rewind(seq, CALIBRATION_PAST)
                seconds[(batch, batch * rows)] = best
    finally:
        for seq in ids:
            cache.free(seq)
    return VerifyCostTable(seconds)


def measure_draft_costs(new_proposer, anchor, vocab: int, batch: int = 8, repeats: int = 3) -> DraftCostTable:
    """Time a proposer mode on synthetic contexts (random tokens, zero hidden states --
    the work a draft does does not depend on the values). A draft model is timed after
    its own prefill, aligning 2 new tokens per round as a real round does."""
    from specserve.engine.options import GenerationOptions
    from specserve.engine.speculative.rounds import proposer_context

    rng = np.random.default_rng(0)
    options = GenerationOptions()
    proposers = [new_proposer() for _ in range(batch)]
    prefixes = [rng.integers(0, vocab, CALIBRATION_PAST).tolist() for _ in range(batch)]
    try:
        for proposer, prefix in zip(proposers, prefixes):  # a draft model prefills its own KV once
            proposer.propose(proposer_context(1, prefix, options, anchor, rng))
        seconds = {}
        for n in (1, batch):
            for num_drafts in (1, 4):
                contexts = [proposer_context(num_drafts, prefix + [1, 2], options, anchor, rng)
                            for prefix in prefixes[:n]]
                best = float("inf")
                for _ in range(repeats):
                    for proposer, prefix in zip(proposers[:n], prefixes[:n]):
                        proposer.rewind(prefix)
                    started = time.perf_counter()
                    if proposers[0].batchable:
                        proposers[0].propose_batch(contexts, proposers[:n])
                    else:
                        for proposer, context in zip(proposers[:n], contexts):
                            proposer.propose(context)
                    best = min(best, time.perf_counter() - started)
                seconds[(n, num_drafts)] = best
        return DraftCostTable(seconds)
    finally:
        for proposer in proposers:
            proposer.close()
