"""Draft-model proposer: a small LM with its own paged KV cache, as the seed's
``DraftModelProposer``. Before proposing it aligns its cache to the target's committed
prefix (rewind to the common prefix, feed what is missing); after each round it rewinds
to the common prefix again."""
from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

from engine.model.cached_decoder import CachedDecoder
from engine.kv.paged_cache import KVCacheCapacityError
from engine.spec.sampling import processed_logits, sample, token_distribution
from engine.spec.proposers.base import AcceptContext, Proposal, ProposerContext

_sequence_ids = itertools.count()


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class DraftModelProposer:
    name = "draft_model"
    batchable = False  # each instance owns one sequence's draft KV

    def __init__(self, draft: CachedDecoder) -> None:
        self.draft = draft
        self.seq_id = ("draft", next(_sequence_ids))
        draft.cache.add_sequence(self.seq_id)
        self.kv_tokens: list[int] = []  # tokens whose KV is in the draft cache, in order

    def propose(self, context: ProposerContext) -> Proposal:
        if context.max_drafts == 0:
            return Proposal([])
        try:
            return self._propose(context)
        except KVCacheCapacityError:
            # The draft's own pool is full: this round goes without drafts (still correct).
            self.rewind([])
            return Proposal([])

    def propose_batch(self, contexts: Sequence[ProposerContext]) -> list[Proposal]:
        return [self.propose(context) for context in contexts]

    def _propose(self, context: ProposerContext) -> Proposal:
        options = context.options
        prefix = list(context.context_tokens)
        logits = self._align(prefix)
        tokens: list[int] = []
        probs: list[np.ndarray] = []
        for i in range(context.max_drafts):
            if i:
                logits = self.draft.feed(self.seq_id, tokens[-1:], len(self.kv_tokens)).logits[-1]
                self.kv_tokens.append(tokens[-1])
            if options.greedy:
                token = int(np.argmax(processed_logits(logits, prefix, options, context.rules)))
            else:  # sample from the draft's own distribution and report it as q
                q = token_distribution(logits, prefix, options, context.rules)
                token = sample(q, context.rng)
                probs.append(q)
            tokens.append(token)
            prefix.append(token)
        return Proposal(tokens, np.stack(probs) if probs else None)

    def _align(self, target_tokens: list[int]) -> np.ndarray:
        """Make the draft cache hold ``target_tokens`` and return the draft's next-token logits."""
        keep = min(common_prefix_len(self.kv_tokens, target_tokens), len(target_tokens) - 1)
        self.rewind(target_tokens[:keep])
        missing = target_tokens[keep:]
        logits = self.draft.feed(self.seq_id, missing, keep).logits[-1]
        self.kv_tokens.extend(missing)
        return logits

    def accept(self, context: AcceptContext) -> None:
        self.rewind(context.target_tokens)

    def rewind(self, target_tokens: Sequence[int]) -> None:
        keep = common_prefix_len(self.kv_tokens, target_tokens)
        if keep < len(self.kv_tokens):
            self.draft.cache.rewind(self.seq_id, keep)
            del self.kv_tokens[keep:]

    def close(self) -> None:
        if self.draft.cache.has_sequence(self.seq_id):
            self.draft.cache.free(self.seq_id)
