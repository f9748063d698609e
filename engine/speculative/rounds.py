"""The pieces of a propose -> verify round that every caller shares.

Each round makes a single target pass over ``[pending, d1 .. dk]``: *pending* is the
last committed token, the target's own choice, not yet in the KV cache. Row i of the
output verifies draft i+1; the row after the last accepted draft gives the correction
(or bonus) token, which becomes the next pending token, and that row's hidden states
are what the heads need next round. Rejected drafts' KV is rewound, and tokens are
committed one at a time through ``SequenceState.commit`` exactly as target-only
decoding commits them.

``verify_on_target`` is the only code that reads logits; it runs next to the KV (in
``sched/target_worker.py``) and returns a small ``RoundOutcome`` -- exactly what a remote
target sends back. ``drafts_allowed``, ``proposer_context``, ``commit_outcome`` and
``record_round`` are used by the scheduler (``sched/``) and by the one-page reference
loop (``speculative/reference.py``) alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import numpy as np

from specserve.engine.errors import EngineError
from specserve.engine.grammar.drafting import DraftGuide
from specserve.engine.grammar.state import GrammarState
from specserve.engine.model.cached_decoder import CachedDecoder, SequenceOutput
from specserve.engine.options import GenerationOptions
from specserve.engine.speculative.proposers.base import Needs, ProposerContext, SharedKvSlice
from specserve.engine.speculative.sampling import SequenceRules, TokenLogprob, token_logprob, token_logprobs
from specserve.engine.speculative.sequence import SequenceState
from specserve.engine.speculative.stats import SpeculativeStats
from specserve.engine.speculative.verify import verify


class NoProgressError(EngineError):
    """A round committed nothing: a bug, never a state to loop in."""


@dataclass(frozen=True)
class Anchor:
    """Target hidden states at the last position in the KV cache (what heads start from)."""

    final: np.ndarray | None = None
    layers: tuple[np.ndarray, ...] | None = None
    shared_kv: tuple[SharedKvSlice, ...] | None = None  # slices of the bound target layers (shared_kv mode)

    @property
    def empty(self) -> bool:
        return self.final is None and self.layers is None and self.shared_kv is None

    @classmethod
    def from_output(cls, out: SequenceOutput, row: int, needs: Needs) -> "Anchor":
        final = out.extras[needs.final_hidden][row] if needs.final_hidden else None
        layers = tuple(out.extras[name][row] for name in needs.layer_hiddens) or None
        return cls(final, layers)


def tokens_left(state: SequenceState) -> int:
    """Most tokens the sequence may still commit: never past max_new_tokens or the
    context limit (at least 1 until it finishes)."""
    return min(state.options.max_new_tokens - len(state.generated), state.max_context - len(state.tokens))


def drafts_allowed(state: SequenceState, num_drafts: int) -> int:
    """Most drafts the next round may verify, of ``num_drafts``: a round commits its
    accepted drafts and one token more, so never past ``tokens_left``, and a verify pass
    never writes KV the sequence cannot keep."""
    return max(0, min(num_drafts, tokens_left(state) - 1))


def proposer_context(num_drafts: int, tokens: list[int], options: GenerationOptions, anchor: Anchor,
                     rng: np.random.Generator | None, rules: SequenceRules | None = None,
                     grammar: DraftGuide | None = None) -> ProposerContext:
    """What a proposer sees, built the same way by every caller."""
    return ProposerContext(num_drafts=num_drafts, context_tokens=tokens, options=options, target_hidden=anchor.final,
                           target_hidden_layers=anchor.layers, shared_kv=anchor.shared_kv, rng=rng, rules=rules,
                           grammar=grammar)


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


@dataclass(frozen=True)
class RoundOutcome:
    """What one round's verification yields for a sequence: O(k + hidden size), never
    logits -- exactly what must cross a process boundary when the target is remote."""

    accepted: int                          # drafts accepted (a prefix)
    tokens: list[int]                      # the accepted drafts, then the correction/bonus token
    logprobs: list[TokenLogprob] | None    # of those tokens, from the target's rows
    anchor: Anchor                         # target hidden states at the last accepted position
    prompt_logprobs: list[TokenLogprob] | None = None  # a prefill's, of prompt tokens 1.. (``prompt_logprobs``)


def prompt_logprobs(target: CachedDecoder, out: SequenceOutput, prompt: list[int], top_n: int) -> list[TokenLogprob]:
    """Each prompt token's log-probability after the tokens before it (so from the second
    on), from a prefill's rows: row i predicts token i + 1."""
    return token_logprobs(out.logits[: len(prompt) - 1], prompt[1:], top_n, target.tokenizer.token_text)


def verify_on_target(target: CachedDecoder, seq_id: Hashable, out: SequenceOutput, drafts: list[int],
                     probs: np.ndarray | None, context: list[int], options: GenerationOptions,
                     rng: np.random.Generator, needs: Needs, rules: SequenceRules,
                     grammar: GrammarState | None = None) -> RoundOutcome:
    """The half of a round that needs the target's logits: accept or reject the drafts
    against the last ``len(drafts) + 1`` rows of ``out`` (masked by the sequence's
    ``grammar``, which moves on with the committed tokens: ``verify``) and rewind the
    rejected KV."""
    rows = out.logits[-(len(drafts) + 1):]  # a prefill's last row, or a round's k + 1 rows
    verdict = verify(rows, drafts, probs, context, options, rng, rules, grammar)
    rejected = len(drafts) - verdict.accepted
    if rejected:
        target.cache.rewind(seq_id, target.cache.length(seq_id) - rejected)
    tokens = [*drafts[: verdict.accepted], verdict.next_token]
    logprobs = ([token_logprob(rows[i], t, options.top_logprobs, target.tokenizer.token_text)
                 for i, t in enumerate(tokens)] if options.logprobs else None)
    anchor_row = verdict.accepted - len(rows)  # index from the end of ``out``: the last accepted position
    return RoundOutcome(verdict.accepted, tokens, logprobs, Anchor.from_output(out, anchor_row, needs))
