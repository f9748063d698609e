"""The target's half of a round, for a target that lives in its own process.

A router sends a batch of small items per tick -- prefills (prompt tokens) and verifies
(just the drafts) -- and gets back one ``RoundOutcome`` per sequence: the accepted
count, the committed tokens, their logprobs and the hidden-state anchor. Logits never
leave this worker and the KV cache never moves: the worker keeps each sequence's
committed tokens, options, sampling generator and grammar state (for a constrained
output) next to its KV pages, so a verify item is O(k). Verification itself is
``speculative/rounds.verify_on_target``, the same code the reference loop runs. The
in-process engine and every target replica run this worker.

Physical KV blocks are granted by the block ledger (in-process, or the KV-manager
actor): a prefill carries the block ids reserved for the sequence and the cache uses
exactly those. With prefix caching the grant's leading blocks may already hold the
prompt's first full blocks (a hit): the prefill shares them and feeds only the rest,
from a block boundary, and always at least its last token -- whose row gives the first
token and every head's anchor, so a hit changes nothing a proposer sees. The worker
names (publishes) a sequence's full blocks of final KV after its prefill and when it
releases it, before the coordinator tells the ledger, so the ledger only ever shares
blocks that hold what it thinks.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np

from specserve.engine.model.cached_decoder import CachedDecoder, FeedRequest
from specserve.engine.sched.calibration import measure_verify_costs
from specserve.engine.sched.cost_tables import VerifyCostTable
from specserve.engine.sched.verify_split import verify_groups
from specserve.engine.errors import EngineError
from specserve.engine.grammar.compiler import GrammarCompiler, grammar_compiler
from specserve.engine.grammar.state import GrammarState
from specserve.engine.options import GenerationOptions
from specserve.engine.speculative.proposers.base import Needs
from specserve.engine.speculative.proposers.shared_kv import shared_kv_slices
from specserve.engine.speculative.rounds import Anchor, RoundOutcome, prompt_logprobs, verify_on_target
from specserve.engine.speculative.sampling import SequenceRules
from specserve.engine.sched.messages import PrefillItem, TargetResult, VerifyItem

log = logging.getLogger("specserve.target")








@dataclass
class _TargetSequence:
    tokens: list[int]             # committed tokens; the last one is pending (not in the KV yet)
    options: GenerationOptions
    needs: Needs
    rng: np.random.Generator
    rules: SequenceRules
    grammar: GrammarState | None = None  # standing at ``tokens`` (its output part), if the output is constrained


class TargetWorker:
    """Owns a target decoder's KV pages and the per-sequence state verification needs."""

    def __init__(self, target: CachedDecoder) -> None:
        self.target = target
        self._seqs: dict[Hashable, _TargetSequence] = {}
        self._costs: VerifyCostTable | None = None

    @property
    def sequences(self) -> list[Hashable]:
        return list(self._seqs)

    def live_grants(self) -> dict[Hashable, list[int]]:
        """Every live sequence's granted blocks, to rebuild a ledger that was lost."""
        return {seq_id: self.target.cache.owned_blocks(seq_id) for seq_id in self._seqs}

    def block_names(self) -> dict[int, int]:
        """Which blocks hold which named (cacheable) KV, to rebuild a ledger that was lost."""
        return self.target.cache.block_names()

    def probe(self) -> None:
        """Health probe: the real target session on one token (raises if it is broken)."""
        self.target.probe()

    def verify_costs(self, max_batch: int = 32) -> VerifyCostTable:
        """The measured cost of verify passes on this target (``sched.calibration``), timed on
        first use and kept. Owners call it at start-up, before taking sequences: it runs
        the target on dummy sequences in free blocks (and so also warms onnxruntime up)."""
        if self._costs is None:
            self._costs = measure_verify_costs(self.target, max_batch)
        return self._costs

    def step(self, prefills: Sequence[PrefillItem] = (), verifies: Sequence[VerifyItem] = (),
             releases: Sequence[Hashable] = ()) -> list[TargetResult]:
        """Free finished sequences, run each prefill alone, then every verify in one batched
        pass. One bad sequence gets an error result; the others are unaffected."""
        self.release(releases)
        results = [self._prefill(item) for item in prefills]
        return results + self._verify(list(verifies))

    def release(self, seq_ids: Sequence[Hashable]) -> None:
        """Free the sequences' pages; the full blocks of their committed tokens stay
        cached for later prompts (the pending token's KV was never computed)."""
        cache = self.target.cache
        for seq_id in seq_ids:
            seq = self._seqs.pop(seq_id, None)
            if cache.has_sequence(seq_id):
                if seq is not None:
                    cache.publish(seq_id, seq.tokens[:-1])
                cache.free(seq_id)

    # -- prefill -------------------------------------------------------------------------
    def _prefill(self, item: PrefillItem) -> TargetResult:
        self.release([item.seq_id])  # a re-prefill replaces whatever was left of the sequence
        cache = self.target.cache
        try:
            if item.resume and item.rules is None:  # its tokens are not its prompt: the rules cannot be derived
                raise ValueError("a resuming prefill must carry the sequence's rules")
            feed = item.fed
            reserved, cached = item.reserved_blocks, item.prefix_blocks
            if cached and not item.resume and item.options.prompt_logprobs is not None:
                raise ValueError("a prefill with prompt_logprobs needs every prompt row: it cannot start on "
                                 "cached blocks")
            cache.add_sequence(item.seq_id, reserved[cached:] if reserved is not None else None)
            start = cache.share_prefix(item.seq_id, feed, reserved[:cached]) if cached else 0
            # The round needs the last row's logits; prompt logprobs need every row's.
            out = self.target.feed_batch([FeedRequest(item.seq_id, feed[start:], start,
                                                      last_logits_only=item.options.prompt_logprobs is None)])[0]
            cache.publish(item.seq_id, feed)
            rules = item.rules or SequenceRules.of(len(item.tokens), item.options, self.target.eos_token_ids)
            seq = _TargetSequence(list(item.tokens), item.options, item.needs,
                                  np.random.default_rng(item.options.seed), rules, self._grammar(item, rules))
            if item.resume:
                outcome = RoundOutcome(0, [], None, Anchor.from_output(out, -1, item.needs))
            else:
                outcome = verify_on_target(self.target, item.seq_id, out, [], None, seq.tokens, item.options,
                                           seq.rng, item.needs, rules, seq.grammar)
                if item.options.prompt_logprobs is not None:
                    outcome = dataclasses.replace(outcome, prompt_logprobs=prompt_logprobs(
                        self.target, out, item.tokens, item.options.prompt_logprobs))
                seq.tokens.extend(outcome.tokens)
            self._seqs[item.seq_id] = seq
            return self._result(item.seq_id, seq, outcome)
        except Exception as exc:  # noqa: BLE001 - reported to the one request that caused it
            self.release([item.seq_id])
            return TargetResult(item.seq_id, None, error=_describe(exc))

    def grammars(self) -> GrammarCompiler:
        """This model's grammar compiler (made on first use; a replica makes it at start-up,
        so its first constrained request does not wait for it)."""
        target = self.target
        return grammar_compiler(target.tokenizer, target.decoder.vocab_size, target.eos_token_ids)

    def _grammar(self, item: PrefillItem, rules: SequenceRules) -> GrammarState | None:
        """The sequence's grammar state, compiled once per grammar for this model: at the
        start of the output, or, for a sequence resuming here after its replica was lost,
        rebuilt from the tokens it had committed (the pending one included: it was chosen
        under the grammar)."""
        spec = item.options.structured_output
        if spec is None:
            return None
        grammar = self.grammars().start(spec)
        if item.resume:
            grammar.replay(item.tokens[rules.prompt_length:])
        return grammar

    # -- verify --------------------------------------------------------------------------
    def _verify(self, items: list[VerifyItem]) -> list[TargetResult]:
        known = [i for i in items if i.seq_id in self._seqs]
        wanted = {i.seq_id: i.anchor for i in known}
        results = {i.seq_id: TargetResult(i.seq_id, None, error="sequence is not on this target replica",
                                          unknown_sequence=True) for i in items if i.seq_id not in self._seqs}
        outcomes = self._rounds(known, self._feed_grouped)
        more = self._more_steps([i for i in known if i.steps > 1 and not i.drafts
                                 and not isinstance(outcomes[i.seq_id], Exception)], outcomes)
        for seq_id, outcome in outcomes.items():
            results[seq_id] = (TargetResult(seq_id, None, error=_describe(outcome)) if isinstance(outcome, Exception)
                               else self._result(seq_id, self._seqs[seq_id], outcome, more.get(seq_id, ()),
                                                 wanted[seq_id]))
        return [results[i.seq_id] for i in items]

    def _rounds(self, items: list[VerifyItem], feed) -> dict[Hashable, RoundOutcome | Exception]:
        """One round for each of these sequences, in one batched call (``feed``) or, if
        that fails, one by one: a sequence that still fails is released and gets its
        exception, and the others are unaffected."""
        requests = [FeedRequest(i.seq_id, [self._seqs[i.seq_id].tokens[-1], *i.drafts],
                                len(self._seqs[i.seq_id].tokens) - 1) for i in items]
        try:
            outputs = feed(requests)
        except Exception:  # noqa: BLE001 - isolate the sequence that broke the batch
            log.exception("batched verify of %d sequences failed; retrying one by one", len(requests))
            outputs = None
        done: dict[Hashable, RoundOutcome | Exception] = {}
        for n, item in enumerate(items):
            seq = self._seqs[item.seq_id]
            try:
                out = outputs[n] if outputs is not None else self.target.feed_batch([requests[n]])[0]
                outcome = verify_on_target(self.target, item.seq_id, out, list(item.drafts), item.probs,
                                           seq.tokens, seq.options, seq.rng, seq.needs, seq.rules, seq.grammar)
            except Exception as exc:  # noqa: BLE001 - reported to the one request it belongs to
                self.release([item.seq_id])
                done[item.seq_id] = exc
                continue
            seq.tokens.extend(outcome.tokens)
            done[item.seq_id] = outcome
        return done

    def _more_steps(self, items: list[VerifyItem], outcomes: dict[Hashable, RoundOutcome | Exception]
                    ) -> dict[Hashable, list[RoundOutcome]]:
        """Run ``steps - 1`` more plain rounds for these sequences, each feeding the token
        the last one chose, as a batch while any is left -- so that the caller's per-round
        work (and, over a network, its hop) is paid once per call, not per token.

        Each is an ordinary round of the sequence (``verify_on_target`` with no drafts:
        same sampling, same random draws, in the same order), so the tokens are those the
        rounds would have given one call at a time. The caller bounds ``steps`` by the
        sequence's budget, so the KV never outgrows its grant; a sequence stops early at
        an end-of-sequence token (stop strings are the caller's: what it does not commit,
        it releases with the sequence). A sequence whose round fails has its outcome
        replaced by the exception, as in ``_verify``. Returns each sequence's further rounds."""
        def ended(seq_id: Hashable, outcome: RoundOutcome) -> bool:
            return outcome.tokens[-1] in self._seqs[seq_id].rules.end_tokens  # EOS unless ignored, stop ids

        more: dict[Hashable, list[RoundOutcome]] = {i.seq_id: [] for i in items}
        left = {i.seq_id: 0 if ended(i.seq_id, outcomes[i.seq_id]) else i.steps - 1 for i in items}
        while going := [i for i in items if left[i.seq_id] > 0]:
            for seq_id, outcome in self._rounds(going, self.target.feed_batch).items():
                left[seq_id] = 0 if isinstance(outcome, Exception) or ended(seq_id, outcome) else left[seq_id] - 1
                if isinstance(outcome, Exception):
                    outcomes[seq_id] = outcome
                    more.pop(seq_id)
                else:
                    more[seq_id].append(outcome)
        return more

    def _feed_grouped(self, requests: list[FeedRequest]) -> list:
        """One padded call, or the sequences without drafts apart from those with them,
        whichever the measured table predicts cheaper (``sched.verify_split``)."""
        outputs: list = [None] * len(requests)
        for group in verify_groups([len(r.tokens) for r in requests], self._costs) if requests else []:
            for i, out in zip(group, self.target.feed_batch([requests[i] for i in group])):
                outputs[i] = out
        return outputs

    def _result(self, seq_id: Hashable, seq: _TargetSequence, outcome: RoundOutcome,
                more: Sequence[RoundOutcome] = (), anchor_wanted: bool = True) -> TargetResult:
        """The call's result for a sequence, with the anchor its proposer starts from next:
        the last round's (after ``more`` plain rounds, theirs), on the first outcome -- where
        callers look, by reference on the server -- with the shared-KV slices the proposer
        reads (after the rewind); the further rounds carry none, and neither does the first
        where the caller did not ask for it."""
        anchor = (more[-1] if more else outcome).anchor if anchor_wanted else Anchor()
        if anchor_wanted and seq.needs.shared_kv_layers:
            anchor = dataclasses.replace(anchor, shared_kv=shared_kv_slices(self.target.cache, seq_id,
                                                                            seq.needs.shared_kv_layers))
        if anchor is not outcome.anchor:
            outcome = dataclasses.replace(outcome, anchor=anchor)
        further = tuple(RoundOutcome(o.accepted, o.tokens, o.logprobs, Anchor()) for o in more)
        return TargetResult(seq_id, outcome, further, kv_length=self.target.cache.length(seq_id))


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, EngineError) else f"{type(exc).__name__}: {exc}"
