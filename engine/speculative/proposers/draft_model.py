"""Draft-model proposer: a small LM with its own paged KV cache, behaving as
``DraftModelProposer`` in ``speculative.rs``. Before proposing it aligns its cache to the target's committed
prefix (rewind to the common prefix, feed what is missing); after each round it rewinds
to the common prefix again.

Every sequence has its own instance (its draft KV), but the instances of one worker
share one draft model and its cache, so ``propose_batch`` drafts for all of them with one
batched run per step: the alignment of every sequence in one call (or a few, below),
then one call per draft position for the sequences still drafting. One by one, a round
would make a call per sequence and draft, each paying a call's fixed cost, which at a
large batch makes drafting dearer than plain decoding; batched, it makes as many calls
as the longest sequence's drafts.

A batched call pads every sequence to the one feeding most, and every fed row costs the
draft's LM head: one sequence catching up a long lag in a call with many aligning two
tokens would make all of them pay for its lag. So the alignment runs in groups of
similar lengths (``align_groups``).

The draft's pool caches prefixes as the target's does (``PagedKVCache.share_prefix``,
its own lookups: no ledger): a first contact starts on the cached blocks of the longest
prefix it has seen before and feeds only the rest, and each alignment names the full
blocks of the committed context, so a shared system prompt costs the draft one prefill
too (docs/design-decisions.md measures it).
"""
from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

from specserve.engine.config import EngineConfig
from specserve.engine.errors import ModelLoadError
from specserve.engine.kv.paged_cache import KVCacheCapacityError
from specserve.engine.model.bundle import Bundle
from specserve.engine.model.cached_decoder import CachedDecoder, FeedRequest
from specserve.engine.speculative.proposers.base import AcceptContext, Proposal, ProposerContext
from specserve.engine.speculative.proposers.mode import LoadedProposer, ProposerMode
from specserve.engine.speculative.sampling import processed_logits, sample, token_distribution

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
    batchable = True  # its own KV per instance, one shared model: ``propose_batch`` drafts into each owner's

    def __init__(self, draft: CachedDecoder) -> None:
        self.draft = draft
        self.seq_id = ("draft", next(_sequence_ids))
        draft.cache.add_sequence(self.seq_id)
        self.kv_tokens: list[int] = []  # tokens whose KV is in the draft cache, in order

    def propose(self, context: ProposerContext) -> Proposal:
        return self.propose_batch([context], [self])[0]

    def propose_batch(self, contexts: Sequence[ProposerContext],
                      owners: Sequence["DraftModelProposer"] | None = None) -> list[Proposal]:
        """Draft for every context into its owner's KV (``owners[i]`` holds ``contexts[i]``'s
        sequence; without owners, this instance holds the one context). If the draft pool
        cannot hold a step, the sequences keep the drafts they have (a round with fewer
        drafts is still exact); if it cannot hold the alignment, those rounds draft nothing."""
        owners = list(owners) if owners is not None else [self]
        if len(owners) != len(contexts):
            raise ValueError(f"{len(contexts)} contexts need as many owners, got {len(owners)}")
        if any(owner.draft is not self.draft for owner in owners):
            raise ValueError("a batched draft runs on one draft model: every owner must share it")
        prefixes = [list(c.context_tokens) for c in contexts]
        tokens: list[list[int]] = [[] for _ in contexts]
        probs: list[list[np.ndarray]] = [[] for _ in contexts]
        aligned = self._align(owners, prefixes, [i for i, c in enumerate(contexts) if c.num_drafts > 0])
        drafting, logits = list(aligned), list(aligned.values())
        step = 0
        while drafting:
            for i, row in zip(drafting, logits):
                token, q = _choose(row, prefixes[i], contexts[i])
                tokens[i].append(token)
                prefixes[i].append(token)
                if q is not None:
                    probs[i].append(q)
            step += 1
            drafting = [i for i in drafting if contexts[i].num_drafts > step and not _stopped(contexts[i])]
            if not drafting:
                break
            try:
                logits = self._step([owners[i] for i in drafting], [tokens[i][-1] for i in drafting])
            except KVCacheCapacityError:
                break
        return [Proposal(t, np.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def _align(self, owners: Sequence["DraftModelProposer"], prefixes: list[list[int]],
               which: list[int]) -> dict[int, np.ndarray]:
        """Make owner i's draft cache hold prefix i, for each i in ``which``, in a few calls
        (``align_groups``); each one's next-token logits, in ``which`` order. A group the
        draft's pool cannot hold is left out: its sequences draft nothing this round."""
        requests = {}
        cache = self.draft.cache
        for i in which:
            owner, prefix = owners[i], prefixes[i]
            keep = min(common_prefix_len(owner.kv_tokens, prefix), len(prefix) - 1)
            owner.rewind(prefix[:keep])
            if not owner.kv_tokens:  # a first contact (or a restart): start on what the pool caches
                keep = cache.share_prefix(owner.seq_id, prefix)
                owner.kv_tokens = prefix[:keep]
            requests[i] = FeedRequest(owner.seq_id, prefix[keep:], keep)
        logits: dict[int, np.ndarray] = {}
        for group in align_groups({i: len(r.tokens) for i, r in requests.items()}):
            try:
                outputs = self.draft.feed_batch([requests[i] for i in group])
            except KVCacheCapacityError:
                for i in group:  # the draft's own pool is full: these rounds go without drafts
                    owners[i].rewind([])
                continue
            for i, output in zip(group, outputs):
                owners[i].kv_tokens.extend(requests[i].tokens)
                # Committed tokens but the last, which the next alignment may feed again for its logits.
                cache.publish(owners[i].seq_id, prefixes[i][:-1])
                logits[i] = output.logits[-1]
        return {i: logits[i] for i in which if i in logits}

    def _step(self, owners: list["DraftModelProposer"], last: list[int]) -> list[np.ndarray]:
        """Feed each owner its last draft, in one call; each one's next-token logits."""
        outputs = self.draft.feed_batch([FeedRequest(o.seq_id, [t], len(o.kv_tokens)) for o, t in zip(owners, last)])
        for owner, token in zip(owners, last):
            owner.kv_tokens.append(token)
        return [output.logits[-1] for output in outputs]

    def accept(self, context: AcceptContext) -> None:
        self.rewind(context.target_tokens)

    def rewind(self, target_tokens: Sequence[int]) -> None:
        keep = common_prefix_len(self.kv_tokens, target_tokens)
        if keep < self.draft.cache.frozen_tokens(self.seq_id):
            self._restart()  # below its named blocks, which no rewind may touch: start over on the cache
        elif keep < len(self.kv_tokens):
            self.draft.cache.rewind(self.seq_id, keep)
            del self.kv_tokens[keep:]

    def _restart(self) -> None:
        self.draft.cache.free(self.seq_id)
        self.draft.cache.add_sequence(self.seq_id)
        self.kv_tokens = []

    def close(self) -> None:
        if self.draft.cache.has_sequence(self.seq_id):
            self.draft.cache.free(self.seq_id)


ALIGN_CALL_ROWS = 20  # a draft-model call's fixed cost in fed rows' worth, as the bundled draft model
                     # times them at a large batch (docs/models.md)


def align_groups(lengths: dict[int, int]) -> list[list[int]]:
    """Sequences (index -> tokens to feed) split into calls, least rows overall: each call
    costs ``ALIGN_CALL_ROWS`` plus its sequences times its longest feed. Sorted by length,
    the best split is into runs, found exactly by dynamic programming (a few dozen
    sequences at most)."""
    order = sorted(lengths, key=lengths.get)
    best = [0.0] + [float("inf")] * len(order)  # best[j]: least cost of the first j
    cut = [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        for i in range(j):
            cost = best[i] + ALIGN_CALL_ROWS + (j - i) * lengths[order[j - 1]]
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(order)
    while j:
        groups.append(order[cut[j]: j])
        j = cut[j]
    return groups[::-1]


def _choose(logits: np.ndarray, prefix: list[int], context: ProposerContext) -> tuple[int, np.ndarray | None]:
    """The next draft: greedy, or drawn from the draft's own distribution, reported as q
    -- under a grammar, over what it allows after the drafts before (q masked too)."""
    options, guide = context.options, context.grammar
    allowed = guide.allowed() if guide is not None else None
    if options.greedy:
        token, q = int(np.argmax(processed_logits(logits, prefix, options, context.rules, allowed))), None
    else:
        q = token_distribution(logits, prefix, options, context.rules, allowed)
        token = sample(q, context.rng)
    if allowed is not None:
        guide.take(token)
    return token, q


def _stopped(context: ProposerContext) -> bool:
    """The grammar allows nothing after this sequence's last draft (it ended the output)."""
    return context.grammar is not None and context.grammar.allowed() is None


class DraftModelMode(ProposerMode):
    mode, deployment = "draft_model", "DraftModelProposer"
    description = "a small LM with its own paged KV cache"

    def provided_by(self, bundle: Bundle | None) -> bool:
        return bundle is not None and bundle.has_draft()

    def load(self, bundle: Bundle, config: EngineConfig, target_vocab: int) -> LoadedProposer:
        # The draft keeps its full context: it is re-aligned to the target every round.
        draft_config = config.model_copy(update={"sliding_window": None, "sink_tokens": 0,
                                                 "intra_op_threads": config.proposer_threads,
                                                 "in_place_threads": None})
        draft = CachedDecoder(bundle.draft_dir(), draft_config)
        if draft.decoder.vocab_size != target_vocab:
            raise ModelLoadError(f"draft vocab {draft.decoder.vocab_size} != target vocab {target_vocab}: a draft "
                                 "must share the target's tokenizer")
        return LoadedProposer(self.mode, lambda: DraftModelProposer(draft), draft)
