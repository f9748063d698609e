"""The propose -> verify rounds of one sequence (target-only decoding is the same rounds
with no proposer).

Each round makes a single target pass over ``[pending, d1 .. dk]``: *pending* is the
last committed token, the target's own choice, not yet in the KV cache. Row i of the
output verifies draft i+1; the row after the last accepted draft gives the correction
(or bonus) token, which becomes the next pending token, and that row's hidden states
are what the heads need next round. Rejected drafts' KV is rewound, and tokens are
committed one at a time through ``SequenceState.commit`` exactly as target-only
decoding commits them.

A round is split in two halves around the target pass -- ``plan`` (propose; say what to
feed) and ``complete`` (verify, rewind, commit, notify the proposer) -- so that one
pass can serve a whole batch of sequences (``batching.py``) with the same algorithm.
Inside ``complete``, ``verify_on_target`` is the only part that reads logits; it returns
a small ``RoundOutcome``, which is exactly what a remote target sends back.

The pieces both transports share live here too: ``draft_width``, ``proposer_context``,
``verify_on_target``, ``commit_outcome`` and ``record_round``. The distributed split of
the same round is ``sequence_driver.py`` (coordinator side), ``target_worker.py`` and
``proposer_worker.py``, driven by ``coordinator.py``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Hashable

import numpy as np

from engine.model.cached_decoder import CachedDecoder, FeedRequest, SequenceOutput
from engine.errors import EngineError
from engine.spec.proposers.base import AcceptContext, Needs, Proposer, ProposerContext, SharedKvSlice
from engine.spec.proposers.shared_kv import shared_kv_slices
from engine.options import GenerationOptions
from engine.spec.sampling import TokenLogprob, token_logprob
from engine.spec.sequence import SequenceState
from engine.spec.stats import SpeculativeStats
from engine.spec.verify import verify


NO_NEEDS = Needs()  # target-only decoding and model-free proposers take nothing from the target


class NoProgressError(EngineError):
    """A round committed nothing: a bug, never a state to loop in."""


@dataclass(frozen=True)
class Anchor:
    """Target hidden states at the last position in the KV cache (what heads start from)."""

    final: np.ndarray | None = None
    layers: tuple[np.ndarray, ...] | None = None
    shared_kv: tuple[SharedKvSlice, ...] | None = None  # set only when the target is remote

    @classmethod
    def from_output(cls, out: SequenceOutput, row: int, needs: Needs) -> "Anchor":
        final = out.extras[needs.final_hidden][row] if needs.final_hidden else None
        layers = tuple(out.extras[name][row] for name in needs.layer_hiddens) or None
        return cls(final, layers)


def draft_width(state: SequenceState, num_drafts: int) -> int:
    """Most tokens the next round may commit (drafts + 1): never past max_new_tokens or
    the context limit, so a verify pass never writes KV the sequence cannot keep."""
    return min(num_drafts + 1, state.options.max_new_tokens - len(state.generated),
               state.max_context - len(state.tokens))


def proposer_context(width: int, tokens: list[int], prompt_len: int, options: GenerationOptions, anchor: Anchor,
                     rng: np.random.Generator | None, text: str = "", shared_kv=None) -> ProposerContext:
    """What a proposer sees, built the same way in-process and on a proposer replica."""
    return ProposerContext(width=width, context_tokens=tokens, generated_tokens=tokens[prompt_len:],
                           generated_text=text, step=len(tokens) - prompt_len, options=options,
                           target_hidden=anchor.final, target_hidden_layers=anchor.layers, rng=rng,
                           shared_kv=shared_kv if shared_kv is not None else anchor.shared_kv)


def commit_outcome(state: SequenceState, outcome: "RoundOutcome") -> int:
    """Commit the outcome's tokens in order until the sequence finishes; returns how many."""
    committed = 0
    for i, token in enumerate(outcome.tokens):
        committed += 1
        if state.commit(token, outcome.logprobs[i] if outcome.logprobs else None):
            break
    return committed


def record_round(stats: SpeculativeStats, drafts: int, accepted: int, committed: int) -> None:
    """Count a verify round; a round that commits nothing is a bug, never a state to loop in."""
    stats.record_round(drafts, accepted, committed)
    if committed == 0:
        raise NoProgressError("speculative decoding made no progress")


class SequenceRounds:
    """One sequence's rounds: its state, its proposer, its place in the target cache."""

    def __init__(self, target: CachedDecoder, seq_id: Hashable, state: SequenceState, proposer: Proposer | None,
                 num_drafts: int, rng: np.random.Generator, stats: SpeculativeStats, needs: Needs = NO_NEEDS) -> None:
        self.target, self.seq_id, self.state, self.proposer = target, seq_id, state, proposer
        self.num_drafts, self.rng, self.stats, self.needs = num_drafts, rng, stats, needs
        self.prefilled = False
        self.resuming = False  # preempted: re-prefill committed tokens, commit nothing new
        self.prefill_seconds = 0.0
        self._anchor = Anchor()
        self._drafts: list[int] = []
        self._probs: np.ndarray | None = None
        self._started = time.perf_counter()

    @property
    def finished(self) -> bool:
        return self.state.finished

    def plan(self) -> FeedRequest:
        """Propose (after the prefill) and return what the target must run this round."""
        state = self.state
        if self.resuming:  # everything committed except the pending token, which the next round feeds
            return FeedRequest(self.seq_id, list(state.tokens[:-1]), 0)
        if not self.prefilled:  # the prefill: the whole prompt, its last row picks the first token
            return FeedRequest(self.seq_id, list(state.tokens), 0)
        width = draft_width(state, self.num_drafts)
        self._drafts, self._probs = [], None
        if self.proposer is not None and width > 1:
            proposal = self.proposer.propose(proposer_context(
                width, state.tokens, state.prompt_len, state.options, self._anchor, self.rng, state.text,
                shared_kv_slices(self.target.cache, self.seq_id, self.needs.shared_kv_layers)
                if self.needs.shared_kv_layers else None))
            self._drafts = [int(t) for t in proposal.tokens[: width - 1]]
            self._probs = None if proposal.probs is None else proposal.probs[: len(self._drafts)]
        return FeedRequest(self.seq_id, [state.tokens[-1], *self._drafts], len(state.tokens) - 1)

    def complete(self, out: SequenceOutput) -> None:
        """Verify this round's drafts against the target's rows and commit the result."""
        state = self.state
        if self.resuming:
            self._anchor = Anchor.from_output(out, -1, self.needs)
            self.resuming = False
            return
        drafts, probs = (self._drafts, self._probs) if self.prefilled else ([], None)
        outcome = verify_on_target(self.target, self.seq_id, out, drafts, probs, state.tokens, state.options,
                                   self.rng, self.needs)
        committed = commit_outcome(state, outcome)
        self._anchor = outcome.anchor
        if not self.prefilled:  # the prefill's last row chose the first token
            self.prefilled = True
            self.prefill_seconds = time.perf_counter() - self._started
            return
        record_round(self.stats, len(drafts), outcome.accepted, committed)
        if self.proposer is not None:
            self.proposer.accept(AcceptContext(outcome.accepted, outcome.tokens[:committed], list(state.tokens)))
        excess = outcome.accepted - committed  # accepted drafts in the KV that a stop left uncommitted
        if excess > 0:
            cache = self.target.cache
            cache.rewind(self.seq_id, cache.length(self.seq_id) - excess)

    def preempt(self) -> None:
        """Give back every KV block; the sequence re-prefills its committed tokens later.

        Nothing committed is lost: the next plan re-feeds all but the pending token, whose
        row restores the heads' anchor, and rounds continue exactly where they stopped."""
        self.target.cache.rewind(self.seq_id, 0)
        self.resuming = self.prefilled and len(self.state.tokens) > 1
        if self.proposer is not None:
            self.proposer.rewind(list(self.state.tokens))


@dataclass(frozen=True)
class RoundOutcome:
    """What one round's verification yields for a sequence: O(k + hidden size), never
    logits -- exactly what must cross a process boundary when the target is remote."""

    accepted: int                          # drafts accepted (a prefix)
    tokens: list[int]                      # the accepted drafts, then the correction/bonus token
    logprobs: list[TokenLogprob] | None    # of those tokens, from the target's rows
    anchor: Anchor                         # target hidden states at the last accepted position


def verify_on_target(target: CachedDecoder, seq_id: Hashable, out: SequenceOutput, drafts: list[int],
                     probs: np.ndarray | None, context: list[int], options: GenerationOptions,
                     rng: np.random.Generator, needs: Needs) -> RoundOutcome:
    """The half of a round that needs the target's logits: accept or reject the drafts
    against the last ``len(drafts) + 1`` rows of ``out`` and rewind the rejected KV."""
    rows = out.logits[-(len(drafts) + 1):]  # a prefill's last row, or a round's k + 1 rows
    verdict = verify(rows, drafts, probs, context, options, rng)
    rejected = len(drafts) - verdict.accepted
    if rejected:
        target.cache.rewind(seq_id, target.cache.length(seq_id) - rejected)
    tokens = [*drafts[: verdict.accepted], verdict.next_token]
    logprobs = ([token_logprob(rows[i], t, options.top_logprobs, target.tokenizer.token_text)
                 for i, t in enumerate(tokens)] if options.logprobs else None)
    anchor_row = verdict.accepted - len(rows)  # index from the end of ``out``: the last accepted position
    return RoundOutcome(verdict.accepted, tokens, logprobs, Anchor.from_output(out, anchor_row, needs))


def decode(target: CachedDecoder, seq_id: Hashable, state: SequenceState, proposer: Proposer | None,
           num_drafts: int, rng: np.random.Generator, stats: SpeculativeStats, needs: Needs = NO_NEEDS) -> float:
    """Run one sequence's rounds on its own until it finishes; returns the prefill seconds."""
    rounds = SequenceRounds(target, seq_id, state, proposer, num_drafts, rng, stats, needs)
    while not rounds.finished:
        rounds.complete(target.feed_batch([rounds.plan()])[0])
    return rounds.prefill_seconds
