"""A proposer's half of a round, for proposers that live in their own process.

The router sends, per sequence and per round, only what changed: the tokens committed
since its last call (O(k)), how many drafts the target accepted, and the target anchor
(hidden states, shared-KV slices). The worker keeps a mirror of each sequence's committed
tokens and one proposer instance per sequence, so a draft model keeps its own KV
between rounds. The in-process engine and every proposer replica run this worker.

Under a structured output the mirror also keeps the sequence's grammar state at its
committed tokens, and the proposer drafts only what the grammar allows (each round's
drafts are stepped through, then rolled back: ``engine/grammar/drafting.py``).

A worker that does not know a sequence (it was routed to a fresh replica, or this one
restarted) answers ``resync``: that round goes without drafts, which is always correct,
and the router sends the whole context next time.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import numpy as np

from specserve.engine.errors import EngineError
from specserve.engine.grammar.compiler import GrammarCompiler
from specserve.engine.grammar.drafting import DraftGuide
from specserve.engine.grammar.state import GrammarState
from specserve.engine.model.cached_decoder import CachedDecoder
from specserve.engine.options import GenerationOptions
from specserve.engine.sched.messages import ProposeItem, ProposeResult
from specserve.engine.sched.metrics import RoundMetrics
from specserve.engine.speculative.proposers.base import AcceptContext, Proposal, Proposer, ProposerContext
from specserve.engine.sched.calibration import CALIBRATION_PAST, measure_draft_costs
from specserve.engine.sched.cost_tables import DraftCostTable
from specserve.engine.speculative.proposers.registry import PROPOSER_MODES, LoadedProposer
from specserve.engine.speculative.rounds import Anchor, proposer_context
from specserve.engine.speculative.sampling import SequenceRules

log = logging.getLogger("specserve.proposer")
IDLE_TIMEOUT_S = 600.0  # a sequence not drafted for this long is dropped (its caller is gone)






@dataclass
class _Mirror:
    proposer: Proposer
    tokens: list[int]
    options: GenerationOptions
    rng: np.random.Generator
    seen: float
    rules: SequenceRules | None = None
    grammar: GrammarState | None = None  # a constrained output's, at ``tokens``: drafts follow it


class ProposerWorker:
    """Per-sequence proposers and token mirrors for one proposer mode."""

    def __init__(self, loaded: LoadedProposer, metrics: RoundMetrics | None = None,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, grammars: Callable[[], GrammarCompiler] | None = None) -> None:
        """``grammars``: the target model's grammar compiler, made on first use, so that a
        constrained output's drafts keep to its grammar (None: drafts ignore grammars)."""
        self.loaded, self.mode, self.idle_timeout_s = loaded, loaded.mode, idle_timeout_s
        self._grammars, self._compiler = grammars, None
        self.guided = grammars is not None  # drafts follow grammars (bench/structured.py measures it off too)
        self.metrics = metrics or RoundMetrics()
        self._seqs: dict[Hashable, _Mirror] = {}
        self._costs: DraftCostTable | None = None

    def probe(self) -> None:
        """Health probe: the real proposer model on a minimal input (raises if broken)."""
        self.loaded.model.probe()

    def draft_costs(self) -> DraftCostTable:
        """What a call costs by batch and drafts (``sched.calibration``), timed on first use on
        synthetic contexts and kept. Owners call it at start-up."""
        if self._costs is None:
            anchor = PROPOSER_MODES[self.mode].calibration_anchor(self.loaded, CALIBRATION_PAST + 1)
            self._costs = measure_draft_costs(self.loaded.new_proposer, anchor, self.loaded.vocab_size)
        return self._costs

    @property
    def sequences(self) -> list[Hashable]:
        return list(self._seqs)

    def active_sequences(self, within_s: float) -> int:
        """Sequences drafted for in the last ``within_s``: those still running here (a
        live sequence asks every round; a dead caller's wait for eviction)."""
        cutoff = time.monotonic() - within_s
        return sum(1 for mirror in self._seqs.values() if mirror.seen >= cutoff)

    def propose(self, items: Sequence[ProposeItem]) -> list[ProposeResult]:
        """Draft for every item (anchors already resolved by the transport). Batchable
        proposers draft for all their sequences in one batched run per step; a failure
        there is retried one sequence at a time, so it stays isolated."""
        self._evict_idle()
        results: dict[Hashable, ProposeResult] = {}
        batch: list[tuple[ProposeItem, ProposerContext, _Mirror]] = []
        guides: list[DraftGuide] = []  # rolled back to the committed tokens once the drafts are made
        try:
            for item in items:
                try:
                    mirror = self._sync(item)
                    if mirror is None:
                        results[item.seq_id] = ProposeResult(item.seq_id, [], resync=True)
                        continue
                    guide = DraftGuide(mirror.grammar) if mirror.grammar is not None else None
                    if guide is not None:
                        guides.append(guide)
                    context = proposer_context(item.num_drafts, mirror.tokens, mirror.options,
                                               item.anchor or Anchor(), mirror.rng, mirror.rules, guide)
                    if mirror.proposer.batchable:
                        batch.append((item, context, mirror))
                    else:
                        results[item.seq_id] = _result(item, mirror.proposer.propose(context))
                except Exception as exc:  # noqa: BLE001 - this round goes on without drafts for it
                    results[item.seq_id] = self._failed(item, exc)
            if len(batch) > 1:
                try:
                    proposals = batch[0][2].proposer.propose_batch([context for _, context, _ in batch],
                                                                   [mirror.proposer for _, _, mirror in batch])
                    results.update((item.seq_id, _result(item, p)) for (item, _, _), p in zip(batch, proposals))
                    batch = []
                except Exception as exc:  # noqa: BLE001 - find the sequence that broke the batch
                    log.warning("%s: batched proposal for %d sequences failed (%r); retrying one by one", self.mode,
                                len(batch), exc)
                    self.metrics.fault("propose_batch_failed", self.mode)
                    for guide in guides:
                        guide.rewind()
            for item, context, mirror in batch:
                try:
                    results[item.seq_id] = _result(item, mirror.proposer.propose(context))
                except Exception as exc:  # noqa: BLE001
                    results[item.seq_id] = self._failed(item, exc)
        finally:
            for guide in guides:
                guide.rewind()
        return [results[item.seq_id] for item in items]

    def reset_prefix_cache(self) -> int:
        """Forget the prefixes a draft model's own KV caches (``DraftModelProposer``);
        heads keep no KV. Returns the cached blocks freed."""
        model = self.loaded.model
        return model.cache.reset_prefix_cache() if isinstance(model, CachedDecoder) else 0

    def release(self, seq_ids: Sequence[Hashable]) -> None:
        for seq_id in seq_ids:
            mirror = self._seqs.pop(seq_id, None)
            if mirror is not None:
                mirror.proposer.close()

    def _failed(self, item: ProposeItem, exc: Exception) -> ProposeResult:
        self.release([item.seq_id])
        message = str(exc) if isinstance(exc, EngineError) else f"{type(exc).__name__}: {exc}"
        return ProposeResult(item.seq_id, [], resync=True, error=message)

    def _sync(self, item: ProposeItem) -> _Mirror | None:
        """Bring the mirror up to the router's committed tokens; None if it cannot be."""
        mirror = self._seqs.get(item.seq_id)
        if item.since == 0:  # the whole context: (re)start the mirror
            if item.options is None:
                raise ValueError("a proposer item with the whole context must carry the request's options")
            if mirror is None:
                seed = item.options.seed
                mirror = _Mirror(self.loaded.new_proposer(), [], item.options,
                                 np.random.default_rng(None if seed is None else [seed, 1]), 0.0)
                self._seqs[item.seq_id] = mirror
            else:
                mirror.proposer.rewind(list(item.new_tokens))
            mirror.tokens, mirror.options, mirror.rules = list(item.new_tokens), item.options, item.rules
            mirror.grammar = None
            self._follow_grammar(mirror, mirror.tokens[item.rules.prompt_length:] if item.rules else None)
        elif mirror is None or len(mirror.tokens) != item.since:
            self.release([item.seq_id])
            return None
        else:
            mirror.tokens.extend(item.new_tokens)
            self._follow_grammar(mirror, item.new_tokens)
            if item.accepted >= 0:
                mirror.proposer.accept(AcceptContext(item.accepted, list(item.new_tokens), list(mirror.tokens)))
        mirror.seen = time.monotonic()
        return mirror

    def grammars(self) -> GrammarCompiler | None:
        """The target model's grammar compiler, made on first use (a replica makes it at
        start-up); None for a worker that drafts without grammars."""
        if self._compiler is None and self._grammars is not None:
            self._compiler = self._grammars()
        return self._compiler

    def _follow_grammar(self, mirror: _Mirror, committed: list[int] | None) -> None:
        """Keep the mirror's grammar state at its committed tokens (``committed``: the output
        tokens it has not taken; at first contact all of them). Drafting by the grammar only
        makes drafts better, so a grammar that cannot be followed here is dropped, never a
        failure: the target holds every output to it anyway."""
        spec = mirror.options.structured_output
        if spec is None or not self.guided or committed is None:
            return
        try:
            if mirror.grammar is None:
                mirror.grammar = self.grammars().start(spec)
            mirror.grammar.replay(committed)
        except Exception as exc:  # noqa: BLE001 - see above
            log.debug("%s: drafting without the grammar (%s)", self.mode, exc)
            mirror.grammar = None
            mirror.options = mirror.options.model_copy(update={"structured_output": None})

    def _evict_idle(self) -> None:
        """Forget sequences nobody has asked about for a long time (their router is gone)."""
        cutoff = time.monotonic() - self.idle_timeout_s
        self.release([s for s, m in self._seqs.items() if m.seen < cutoff])


def _result(item: ProposeItem, proposal: Proposal) -> ProposeResult:
    drafts = [int(t) for t in proposal.tokens[: item.num_drafts]]
    probs = None if proposal.probs is None else proposal.probs[: len(drafts)]
    return ProposeResult(item.seq_id, drafts, probs)
