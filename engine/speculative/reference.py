"""Speculative decoding on one page: the reference loop, read this first.

One sequence, no batching, no scheduler, no processes -- just the algorithm:

    prefill the prompt; its last row picks the first token (the *pending* token)
    repeat:
        propose up to k drafts after the pending token
        run the target once over [pending, d1 .. dk]      (k + 1 rows of logits)
        accept the longest prefix the target agrees with, plus one token of its own
        commit those tokens; rewind the KV past the rejected drafts

Greedy: a draft is accepted while it equals the target's argmax. Sampling: draft d_i is
accepted with probability min(1, p(d_i) / q(d_i)), and a rejection resamples from
norm(max(0, p - q)) (``verify.py``), so the output has exactly the target's distribution.
A structured output's grammar masks the target's logits at every verified position, with
the drafts accepted before it: a draft the grammar forbids is rejected like any other.

The scheduler (``sched/``) runs the same steps for many sequences at once, split between
workers; its tests compare against this loop. Random numbers follow the scheduler's
convention so a seeded request gives the same tokens here and there: the verifier draws
from ``default_rng(seed)``, a sampling drafter from ``default_rng([seed, 1])``.
"""
from __future__ import annotations

import itertools

import numpy as np

from specserve.engine.grammar.compiler import grammar_compiler
from specserve.engine.grammar.drafting import DraftGuide
from specserve.engine.model.cached_decoder import CachedDecoder
from specserve.engine.options import GenerationOptions
from specserve.engine.speculative.proposers.base import NO_NEEDS, AcceptContext, Needs, Proposer
from specserve.engine.speculative.proposers.shared_kv import shared_kv_slices
from specserve.engine.speculative.rounds import (Anchor, commit_outcome, drafts_allowed, proposer_context, record_round,
                                       verify_on_target)
from specserve.engine.speculative.sequence import SequenceState
from specserve.engine.speculative.stats import SpeculativeStats

_ids = itertools.count()


def speculative_decode(target: CachedDecoder, prompt_ids: list[int], options: GenerationOptions,
                       proposer: Proposer | None = None, num_drafts: int = 4,
                       needs: Needs = NO_NEEDS) -> tuple[SequenceState, SpeculativeStats]:
    """Decode one request; ``proposer=None`` is plain target-only decoding."""
    state = SequenceState(prompt_ids, options, target.tokenizer, target.eos_token_ids, target.max_context)
    stats = SpeculativeStats(mode=proposer.name if proposer else "none")
    seed = options.seed
    verifier_rng = np.random.default_rng(seed)
    drafter_rng = np.random.default_rng(None if seed is None else [seed, 1])
    # A structured output's grammar masks every verified position (``verify``); the drafter
    # follows its own copy, to draft only what the grammar allows (``grammar/drafting.py``).
    spec = options.structured_output
    compiler = spec and grammar_compiler(target.tokenizer, target.decoder.vocab_size, target.eos_token_ids)
    grammar, draft_grammar = (compiler.start(spec), compiler.start(spec)) if spec else (None, None)
    seq = ("reference", next(_ids))
    target.cache.add_sequence(seq)
    try:
        out = target.feed(seq, state.tokens, 0)                       # prefill
        outcome = verify_on_target(target, seq, out, [], None, state.tokens, options, verifier_rng, needs,
                                   state.rules, grammar)
        commit_outcome(state, outcome)                                # the first token
        if draft_grammar is not None:
            draft_grammar.replay(outcome.tokens)
        while not state.finished:
            most = drafts_allowed(state, num_drafts)
            drafts, probs = [], None
            if proposer is not None and most > 0:                     # 1. propose
                anchor = outcome.anchor
                if needs.shared_kv_layers:
                    anchor = Anchor(anchor.final, anchor.layers, shared_kv_slices(target.cache, seq,
                                                                                  needs.shared_kv_layers))
                guide = DraftGuide(draft_grammar) if draft_grammar is not None else None
                proposal = proposer.propose(
                    proposer_context(most, state.tokens, options, anchor, drafter_rng, state.rules, guide))
                if guide is not None:
                    guide.rewind()
                drafts = [int(t) for t in proposal.tokens[:most]]
                probs = None if proposal.probs is None else proposal.probs[: len(drafts)]
            pending = len(state.tokens) - 1                           # 2. one target pass
            out = target.feed(seq, [state.tokens[-1], *drafts], pending)
            outcome = verify_on_target(target, seq, out, drafts, probs,  # 3. accept (+ rewind rejected KV)
                                       state.tokens, options, verifier_rng, needs, state.rules, grammar)
            committed = commit_outcome(state, outcome)                # 4. commit
            if draft_grammar is not None and not state.finished:
                draft_grammar.replay(outcome.tokens[:committed])
            record_round(stats, len(drafts), outcome.accepted, committed)
            if proposer is not None:
                proposer.accept(AcceptContext(outcome.accepted, outcome.tokens[:committed], list(state.tokens)))
        return state, stats
    finally:
        target.cache.free(seq)
