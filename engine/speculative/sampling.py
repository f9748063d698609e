"""Turning logits into the next token: processors, greedy choice, seeded sampling, logprobs.

``token_distribution`` is the single definition of "what the target would sample from"
at one position; speculative verification reuses it at every verified position so that
speculative sampling has exactly the target-only output distribution.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from specserve.engine.options import GenerationOptions


def apply_repetition_penalty(logits: np.ndarray, context: Sequence[int], penalty: float) -> np.ndarray:
    """HF/CTRL rule: divide positive logits, multiply negative ones, of tokens already seen."""
    if penalty == 1.0 or not len(context):
        return logits
    seen = np.unique(np.asarray(context, dtype=np.int64))
    seen = seen[seen < logits.shape[-1]]
    out = logits.astype(np.float32, copy=True)
    values = out[seen]
    out[seen] = np.where(values > 0, values / penalty, values * penalty)
    return out


@dataclass(frozen=True)
class SequenceRules:
    """What logit processing needs to know about a sequence beyond its options: where its
    prompt ends (presence and frequency penalties and ``min_tokens`` count generated
    tokens only, as vLLM does) and which tokens would end it (EOS unless ignored, and
    ``stop_token_ids``: masked out until ``min_tokens`` are generated)."""

    prompt_length: int
    end_tokens: frozenset[int] = frozenset()

    @classmethod
    def of(cls, prompt_length: int, options: GenerationOptions, eos_token_ids: Sequence[int]) -> "SequenceRules":
        eos = () if options.ignore_eos else eos_token_ids
        return cls(prompt_length, frozenset(eos) | frozenset(options.stop_token_ids))


def processed_logits(logits: np.ndarray, context: Sequence[int], options: GenerationOptions,
                     rules: SequenceRules | None = None, allowed: np.ndarray | None = None) -> np.ndarray:
    """The logits a token is chosen from after ``context``, in vLLM's order: the bias and
    ``min_tokens``' mask first, then the repetition penalty (over the whole context), then
    the presence and frequency penalties (over the generated tokens), then the grammar's
    mask (``allowed``: the tokens its state after ``context`` allows; last, so what it
    forbids stays impossible whatever the rules before it did). ``rules`` None: the
    whole context is prompt (a drafter that does not know the sequence: its drafts only
    need to be good guesses). Float32, a new array only where something applies."""
    out = logits
    vocab = logits.shape[-1]
    if options.logit_bias:
        ids = np.fromiter((t for t, _ in options.logit_bias), np.int64, len(options.logit_bias))
        bias = np.fromiter((b for _, b in options.logit_bias), np.float32, len(options.logit_bias))
        out = out.astype(np.float32, copy=True)
        out[ids[ids < vocab]] += bias[ids < vocab]
    generated = len(context) - rules.prompt_length if rules is not None else 0
    if options.min_tokens and generated < options.min_tokens and rules is not None and rules.end_tokens:
        out = out.astype(np.float32, copy=out is logits)
        out[[t for t in rules.end_tokens if t < vocab]] = -np.inf
    out = apply_repetition_penalty(out, context, options.repetition_penalty)
    if (options.presence_penalty or options.frequency_penalty) and generated > 0:
        tokens = np.asarray(context[len(context) - generated:], dtype=np.int64)
        counts = np.bincount(tokens[tokens < vocab], minlength=vocab).astype(np.float32)
        out = out - (np.float32(options.frequency_penalty) * counts
                     + np.float32(options.presence_penalty) * (counts > 0).astype(np.float32))
    if allowed is not None:
        out = np.where(allowed, out, np.float32(-np.inf)).astype(np.float32, copy=False)
    return out


def token_distribution(logits: np.ndarray, context: Sequence[int], options: GenerationOptions,
                       rules: SequenceRules | None = None, allowed: np.ndarray | None = None) -> np.ndarray:
    """Sampling distribution (float64, sums to 1) after penalty, temperature, top-k, top-p
    (and a grammar's mask, ``allowed``: see ``processed_logits``).

    Greedy requests get the one-hot distribution of their argmax, which makes greedy a
    special case of the same rule.
    """
    scores = processed_logits(logits, context, options, rules, allowed).astype(np.float64)
    if options.greedy:
        probs = np.zeros_like(scores)
        probs[int(np.argmax(scores))] = 1.0
        return probs
    scores = scores / options.temperature
    if options.top_k and options.top_k < scores.shape[-1]:
        kth = np.partition(scores, -options.top_k)[-options.top_k]
        scores = np.where(scores < kth, -np.inf, scores)
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    if options.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        # Keep the smallest prefix whose mass reaches top_p (always at least one token);
        # the epsilon keeps float rounding from adding a token when the mass is exact.
        cutoff = int(np.searchsorted(cumulative, options.top_p - 1e-9, side="left")) + 1
        keep = np.zeros_like(probs, dtype=bool)
        keep[order[:cutoff]] = True
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum()
    return probs


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw with one uniform number: reproducible for a given seed."""
    cumulative = np.cumsum(probs)
    index = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    return min(index, len(probs) - 1)


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of a chosen token under the model's raw (unprocessed) distribution,
    as vLLM reports by default, plus the most likely alternatives."""

    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = field(default_factory=tuple)


def token_logprob(logits: np.ndarray, token_id: int, top_n: int, token_text) -> TokenLogprob:
    return token_logprobs(logits[None], [token_id], top_n, token_text)[0]


def token_logprobs(rows: np.ndarray, tokens: Sequence[int], top_n: int, token_text) -> list[TokenLogprob]:
    """Each row's log-probability of its token (row i, token i), under the raw softmax,
    and the ``top_n`` likeliest alternatives: vectorised over the rows, so a prompt's
    (``prompt_logprobs``) cost stays numpy's."""
    if not len(tokens):
        return []
    values = rows.astype(np.float64)
    logp = values - values.max(axis=-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(axis=-1, keepdims=True))
    chosen = logp[np.arange(len(tokens)), np.asarray(tokens)]
    best = None
    if top_n:
        best = np.argpartition(-logp, top_n, axis=-1)[:, :top_n]
        order = np.argsort(-np.take_along_axis(logp, best, axis=-1), axis=-1, kind="stable")
        best = np.take_along_axis(best, order, axis=-1)
    return [TokenLogprob(int(token), token_text(int(token)), float(chosen[i]),
                         tuple(TopLogprob(int(t), token_text(int(t)), float(logp[i, t])) for t in best[i])
                         if best is not None else ())
            for i, token in enumerate(tokens)]
