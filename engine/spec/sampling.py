"""Turning logits into the next token: processors, greedy choice, seeded sampling, logprobs.

``token_distribution`` is the single definition of "what the target would sample from"
at one position; speculative verification reuses it at every verified position so that
speculative sampling has exactly the target-only output distribution.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from engine.options import GenerationOptions


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


def processed_logits(logits: np.ndarray, context: Sequence[int], options: GenerationOptions) -> np.ndarray:
    return apply_repetition_penalty(logits, context, options.repetition_penalty)


def token_distribution(logits: np.ndarray, context: Sequence[int], options: GenerationOptions) -> np.ndarray:
    """Sampling distribution (float64, sums to 1) after penalty, temperature, top-k, top-p.

    Greedy requests get the one-hot distribution of their argmax, which makes greedy a
    special case of the same rule.
    """
    scores = processed_logits(logits, context, options).astype(np.float64)
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


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def token_logprob(logits: np.ndarray, token_id: int, top_n: int, token_text) -> TokenLogprob:
    logp = log_softmax(logits)
    top: tuple[TopLogprob, ...] = ()
    if top_n:
        best = np.argpartition(-logp, top_n)[:top_n]
        best = best[np.argsort(-logp[best], kind="stable")]
        top = tuple(TopLogprob(int(t), token_text(int(t)), float(logp[t])) for t in best)
    return TokenLogprob(token_id, token_text(token_id), float(logp[token_id]), top)
