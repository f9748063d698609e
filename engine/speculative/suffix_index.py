"""Suffix matching over token histories: the data structure behind suffix decoding.

SuffixDecoding (ArcticInference, arXiv 2411.04975) drafts from a depth-limited suffix
tree: it matches the context's longest recent suffix, then follows the most frequent
continuation while its estimated probability (counts at each branch, multiplied along
the path) stays above ``min_token_prob``; a match of ``m`` tokens drafts at most
``max_spec_factor * m + max_spec_offset`` tokens, and match plus draft fit in
``max_depth``. Every match length is scored (the sum of its drafts' probabilities) and
the best one wins.

Here the same counts come from an index instead of a tree: every bigram of every
sequence is mapped to the positions where it ends. A lookup takes the positions of the
context's last bigram (the most recent ``max_candidates`` of them), extends each match
backwards, and counts continuations over the positions whose match is at least each
length -- exactly the counts a depth-limited suffix tree keeps at that node. A Python
tree would hold a node per (position, depth): 24 nodes per token, where the index holds
one entry per token (docs/speculative-decoding.md#suffix-decoding).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

KEY_SHIFT = 32  # a bigram's key: first token << KEY_SHIFT | second (token ids < 2**32)


@dataclass(frozen=True)
class SuffixParams:
    max_depth: int = 24          # match plus draft, in tokens (vLLM's suffix_decoding_max_tree_depth)
    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1
    min_match: int = 3           # shorter matches draft nothing (see ``SpeculativeConfig.suffix_min_match``)
    max_candidates: int = 256    # most recent occurrences of the last bigram a lookup reads


@dataclass
class SuffixDraft:
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # each token's estimated probability (path product)
    match_len: int = 0

    @property
    def score(self) -> float:
        """Expected accepted tokens, as SuffixDecoding ranks drafts."""
        return sum(self.probs)


def _key(first: int, second: int) -> int:
    return first << KEY_SHIFT | second


class TokenIndex:
    """Token sequences, and for every bigram in them the (sequence, position) where it ends."""

    def __init__(self) -> None:
        self.sequences: dict[int, list[int]] = {}
        self._ends: dict[int, list[tuple[int, int]]] = {}
        self.entries = 0  # index entries, live or not (a removed sequence's stay until ``compact``)
        self.tokens = 0   # in the sequences it holds

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        seq = self.sequences.setdefault(seq_id, [])
        ends = self._ends
        for token in tokens:
            token = int(token)
            if seq:
                ends.setdefault(_key(seq[-1], token), []).append((seq_id, len(seq)))
                self.entries += 1
            seq.append(token)
        self.tokens += len(tokens)

    def remove(self, seq_id: int) -> None:
        """Forget a sequence; its index entries are skipped until the next ``compact``."""
        self.tokens -= len(self.sequences.pop(seq_id, ()))

    def compact(self) -> None:
        """Drop the index entries of removed sequences."""
        live = self.sequences
        for key in list(self._ends):
            kept = [entry for entry in self._ends[key] if entry[0] in live]
            if kept:
                self._ends[key] = kept
            else:
                del self._ends[key]
        self.entries = sum(len(v) for v in self._ends.values())

    def speculate(self, context: Sequence[int], max_tokens: int, params: SuffixParams,
                  skip: tuple[int, int] | None = None) -> SuffixDraft:
        """The best draft continuing ``context``; ``skip``: an occurrence not to count
        (the context's own end, when the context is one of the indexed sequences)."""
        if len(context) < 2 or max_tokens <= 0:
            return SuffixDraft()
        occurrences = self._ends.get(_key(context[-2], context[-1]))
        if not occurrences:
            return SuffixDraft()
        depth = params.max_depth
        matches: list[tuple[int, list[int], int]] = []  # (match length, sequence, next position)
        sequences = self.sequences
        for i in range(len(occurrences) - 1, -1, -1):
            seq_id, end = occurrences[i]
            seq = sequences.get(seq_id)
            if seq is None or (seq_id, end) == skip:
                continue
            length, most = 2, min(depth, end + 1, len(context))
            while length < most and seq[end - length] == context[-1 - length]:
                length += 1
            matches.append((length, seq, end + 1))
            if len(matches) >= params.max_candidates:
                break
        if not matches:
            return SuffixDraft()
        best = SuffixDraft()
        lengths = sorted({m[0] for m in matches if m[0] >= params.min_match})
        floor = max(params.min_match, 2) - 1  # claimed match lengths start at min_match
        for match_len in lengths:  # the occurrences matching at least each length, longest last
            limit = max(self._limit(n, max_tokens, params) for n in range(floor + 1, match_len + 1))
            floor = match_len
            draft = self._follow([(seq, nxt) for length, seq, nxt in matches if length >= match_len], limit,
                                 params.min_token_prob)
            draft.match_len = match_len
            if draft.score >= best.score:
                best = draft
        return best

    @staticmethod
    def _limit(match_len: int, max_tokens: int, params: SuffixParams) -> int:
        by_match = int(match_len * params.max_spec_factor + params.max_spec_offset + 1e-6)
        return max(0, min(max_tokens, by_match, params.max_depth - match_len))

    @staticmethod
    def _follow(cursors: list[tuple[list[int], int]], limit: int, min_prob: float) -> SuffixDraft:
        """Follow the most frequent continuation (ties: the most recent occurrence) while
        its probability stays at least ``min_prob``."""
        draft, prob = SuffixDraft(), 1.0
        while len(draft.tokens) < limit and cursors:
            counts = Counter(seq[i] for seq, i in cursors if i < len(seq))
            if not counts:
                break
            token, count = counts.most_common(1)[0]
            prob *= count / len(cursors)
            if prob < min_prob:
                break
            draft.tokens.append(token)
            draft.probs.append(prob)
            cursors = [(seq, i + 1) for seq, i in cursors if i < len(seq) and seq[i] == token]
        return draft


class SuffixCache:
    """Earlier requests' outputs, for every request of one coordinator to draft from:
    SuffixDecoding's global tree. Holds at most ``max_cached_requests`` outputs, oldest
    out first; 0 keeps none."""

    def __init__(self, max_cached_requests: int) -> None:
        self.max_cached_requests = max_cached_requests
        self.index = TokenIndex()
        self._next_id = 0

    def __len__(self) -> int:
        return len(self.index.sequences)

    def add(self, output: Sequence[int]) -> None:
        if self.max_cached_requests <= 0 or len(output) < 2:
            return
        index = self.index
        index.extend(self._next_id, output)
        self._next_id += 1
        while len(index.sequences) > self.max_cached_requests:
            index.remove(next(iter(index.sequences)))  # dicts keep insertion order: the oldest
        if index.entries > 2 * max(1, index.tokens):
            index.compact()  # removed outputs' entries never outnumber the live ones for long

    def clear(self) -> None:
        self.index = TokenIndex()

    def speculate(self, context: Sequence[int], max_tokens: int, params: SuffixParams) -> SuffixDraft:
        return self.index.speculate(context, max_tokens, params)
