"""The coordinator's half of a round: one request's state between remote workers.

Where the in-process ``SequenceRounds`` calls its proposer and target directly, a
``SequenceDriver`` only builds the small messages for them (``PrefillItem``,
``ProposeItem``, ``VerifyItem``) and applies what comes back, using the same pieces of
``rounds.py``: ``draft_width``, ``commit_outcome`` (through ``SequenceState.commit``) and
``record_round``. A model-free proposer (prompt lookup) runs right here: it needs only
the committed tokens, which the coordinator already holds, so a hop would cost more
than the lookup.

The anchor is opaque here: a value in-process, an object-store reference when the
target is remote -- the coordinator passes it on without looking inside.
"""
from __future__ import annotations

from typing import Any, Hashable, NamedTuple, Sequence

from engine.errors import InvalidRequestError
from engine.options import SPECULATIVE_MODES, GenerationOptions, SpeculativeConfig
from engine.sched.proposer_worker import ProposeItem, ProposeResult
from engine.spec.proposers.prompt_lookup import PromptLookupProposer
from engine.spec.proposers.base import AcceptContext, Needs, Proposer
from engine.spec.rounds import Anchor, RoundOutcome, commit_outcome, draft_width, proposer_context, record_round
from engine.spec.sequence import SequenceState, TokenCallback
from engine.spec.stats import SpeculativeStats
from engine.sched.target_worker import PrefillItem, VerifyItem
from engine.model.tokenizer import TextTokenizer, encode_prompt


class VerifiedRound(NamedTuple):
    drafts: int
    accepted: int
    committed: int


class SequenceDriver:
    def __init__(self, seq_id: Hashable, state: SequenceState, mode: str, num_drafts: int, needs: Needs,
                 local_proposer: Proposer | None = None, remote_proposer: bool = False) -> None:
        self.seq_id, self.state, self.mode, self.num_drafts, self.needs = seq_id, state, mode, num_drafts, needs
        self.local_proposer, self.remote_proposer = local_proposer, remote_proposer
        self.stats = SpeculativeStats(mode=mode)
        self.prefilled = False
        self.resuming = False
        self.anchor: Any = None
        self._proposer_has = 0          # committed tokens the remote proposer has seen
        self._last_accepted = -1
        self._drafts: list[int] = []
        self._probs: Any = None

    @property
    def finished(self) -> bool:
        return self.state.finished

    @property
    def needs_prefill(self) -> bool:
        """The next target pass is a prefill: a new request, or one whose KV was lost."""
        return not self.prefilled or self.resuming

    # -- what to send --------------------------------------------------------------------
    def prefill_item(self, reserved_blocks: list[int] | None) -> PrefillItem:
        """The prompt, or, after the sequence lost its target, every committed token."""
        return PrefillItem(self.seq_id, list(self.state.tokens), self.state.options, self.needs, reserved_blocks,
                           resume=self.resuming)

    def width(self) -> int:
        return draft_width(self.state, self.num_drafts) if self.prefilled else 1

    def propose_item(self) -> ProposeItem | None:
        """The message for a remote proposer this round, or None if no drafts are wanted."""
        self.no_drafts()
        width = self.width()
        if not self.remote_proposer or width <= 1:
            return None
        tokens = self.state.tokens
        since = self._proposer_has
        self._proposer_has = len(tokens)
        return ProposeItem(self.seq_id, width, since, tokens[since:], self.state.prompt_len,
                           None if since else self.state.options, self._last_accepted if since else -1, self.anchor)

    def propose_locally(self) -> None:
        """Draft with the in-coordinator (model-free) proposer, if this request has one."""
        self.no_drafts()
        width = self.width()
        if self.local_proposer is None or width <= 1:
            return
        state = self.state
        proposal = self.local_proposer.propose(proposer_context(width, state.tokens, state.prompt_len,
                                                                state.options, Anchor(), None, state.text))
        self._drafts = [int(t) for t in proposal.tokens[: width - 1]]

    def no_drafts(self) -> None:
        """This round verifies no drafts (its proposer is unavailable)."""
        self._drafts, self._probs = [], None

    def take_proposal(self, result: ProposeResult) -> None:
        if result.resync:
            self._proposer_has = 0  # send everything next round; this round has no drafts
            self.no_drafts()
            return
        self._drafts, self._probs = list(result.tokens), result.probs

    def verify_item(self) -> VerifyItem:
        return VerifyItem(self.seq_id, list(self._drafts), self._probs)

    # -- what came back ------------------------------------------------------------------
    def complete(self, outcome: RoundOutcome, anchor: Any) -> VerifiedRound | None:
        """Commit a round's (or the prefill's) outcome; returns what a verify round did
        (None for a prefill or a resume), for the coordinator's metrics."""
        self.anchor = anchor
        if self.resuming:
            self.resuming = False
            return None
        committed = commit_outcome(self.state, outcome)
        if not self.prefilled:
            self.prefilled = True
            return None
        record_round(self.stats, len(self._drafts), outcome.accepted, committed)
        self._last_accepted = outcome.accepted
        if self.local_proposer is not None:
            self.local_proposer.accept(AcceptContext(outcome.accepted, outcome.tokens[:committed],
                                                     list(self.state.tokens)))
        return VerifiedRound(len(self._drafts), outcome.accepted, committed)

    def lost_target(self) -> None:
        """The target holding this sequence's KV is gone: re-prefill what is committed."""
        self.resuming = self.prefilled
        self._proposer_has = 0
        self.no_drafts()


class DriverFactory:
    """Turns a request into a ``SequenceDriver``: picks the mode, checks it is served,
    builds the committed-token state and says how much KV to reserve."""

    def __init__(self, tokenizer: TextTokenizer, eos_token_ids: Sequence[int], max_context: int, vocab_size: int,
                 speculative: SpeculativeConfig, remote_needs: dict[str, Needs]) -> None:
        self.tokenizer, self.eos_token_ids, self.max_context = tokenizer, tuple(eos_token_ids), max_context
        self.vocab_size = vocab_size
        self.speculative, self.remote_needs = speculative, dict(remote_needs)

    @property
    def modes(self) -> list[str]:
        local = ("none", "prompt_lookup")
        return [m for m in SPECULATIVE_MODES if m in local or m in self.remote_needs]

    def resolve_mode(self, options: GenerationOptions) -> tuple[str, int]:
        mode = options.speculative_mode or self.speculative.default_mode
        if mode not in self.modes:
            raise InvalidRequestError(f"speculative mode '{mode}' is not loaded on this server "
                                      f"(available: {', '.join(self.modes)})")
        return mode, options.num_speculative_tokens or self.speculative.num_speculative_tokens

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, self.vocab_size, self.max_context)

    def create(self, seq_id: Hashable, prompt_ids: list[int], options: GenerationOptions,
               on_token: TokenCallback | None = None) -> tuple[SequenceDriver, int]:
        """The driver and the KV tokens to reserve for its worst case."""
        mode, k = self.resolve_mode(options)
        state = SequenceState(prompt_ids, options, self.tokenizer, self.eos_token_ids, self.max_context, on_token)
        local = PromptLookupProposer(self.speculative.prompt_lookup_ngram, k) if mode == "prompt_lookup" else None
        driver = SequenceDriver(seq_id, state, mode, k, self.remote_needs.get(mode, Needs()), local,
                                remote_proposer=mode in self.remote_needs)
        return driver, min(len(prompt_ids) + options.max_new_tokens, self.max_context)
