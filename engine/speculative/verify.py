"""Verification: which drafts the target accepts, and the token it adds after them.

Greedy: accept the longest prefix of drafts equal to the target's (processed) argmax;
then the target's argmax at the first mismatch (correction) or after the last draft
(bonus). Sampling (temperature > 0): lossless speculative sampling (Leviathan et al.
2023; Chen et al. 2023): accept draft x with probability min(1, p(x)/q(x)); on
rejection sample from norm(max(0, p - q)); if all pass, sample the bonus from p. A
proposer without probabilities has one-hot q. ``p`` at every position comes from
``sampling.token_distribution`` with that position's own context, the same rule
target-only decoding uses, so the output distribution is exactly the target's; a
grammar's mask is one more rule of that function.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from specserve.engine.grammar.state import GrammarState
from specserve.engine.options import GenerationOptions
from specserve.engine.speculative.sampling import SequenceRules, processed_logits, sample, token_distribution


@dataclass(frozen=True)
class Verdict:
    accepted: int     # number of drafts accepted (a prefix)
    next_token: int   # correction (at the first rejection) or bonus (after all drafts)


def verify(logits: np.ndarray, drafts: Sequence[int], draft_probs: np.ndarray | None, context: Sequence[int],
           options: GenerationOptions, rng: np.random.Generator, rules: SequenceRules,
           grammar: GrammarState | None = None) -> Verdict:
    """``logits[i]`` is the target's output after ``context + drafts[:i]`` (len(drafts)+1 rows).

    With a ``grammar`` (standing at ``context``), position i's distribution is masked by
    what the grammar allows after the drafts accepted before it, and the grammar advances
    with each token as it is accepted: a draft it forbids has probability 0, so it is
    rejected and the target's masked choice taken, and the grammar ends the round standing
    at the round's committed tokens, having never taken a rejected one."""
    if len(logits) != len(drafts) + 1:
        raise ValueError(f"need {len(drafts) + 1} logit rows for {len(drafts)} drafts, got {len(logits)}")
    prefix = list(context) if drafts else context  # extended per accepted draft below
    for i, draft in enumerate(drafts):
        allowed = grammar.allowed() if grammar is not None else None
        if options.greedy:
            choice = int(np.argmax(processed_logits(logits[i], prefix, options, rules, allowed)))
            if choice != draft:
                return _taken(Verdict(i, choice), grammar)
        else:
            p = token_distribution(logits[i], prefix, options, rules, allowed)
            q = _one_hot(draft, p.shape[-1]) if draft_probs is None else draft_probs[i].astype(np.float64)
            if rng.random() * q[draft] >= p[draft]:  # reject with probability 1 - min(1, p/q)
                residual = np.maximum(p - q, 0.0)
                return _taken(Verdict(i, sample(residual if residual.sum() > 0 else p, rng)), grammar)
        if grammar is not None:
            grammar.advance(draft)
        prefix.append(draft)
    allowed = grammar.allowed() if grammar is not None else None
    if options.greedy:
        return _taken(Verdict(len(drafts), int(np.argmax(processed_logits(logits[-1], prefix, options, rules,
                                                                           allowed)))), grammar)
    return _taken(Verdict(len(drafts), sample(token_distribution(logits[-1], prefix, options, rules, allowed), rng)),
                  grammar)


def _taken(verdict: Verdict, grammar: GrammarState | None) -> Verdict:
    """The round's own token is committed too: the grammar takes it."""
    if grammar is not None:
        grammar.advance(verdict.next_token)
    return verdict


def _one_hot(token: int, size: int) -> np.ndarray:
    q = np.zeros(size)
    q[token] = 1.0
    return q
