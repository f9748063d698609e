"""The coordinator's half of a round: one request's state between the workers.

A ``SequenceDriver`` never touches a model: it builds the small messages for the
target and proposer workers (``PrefillItem``, ``ProposeItem``, ``VerifyItem``) and applies
what comes back, using the pieces of ``speculative/rounds.py``: ``drafts_allowed``,
``commit_outcome`` (through ``SequenceState.commit``) and ``record_round``. A model-free
proposer (prompt lookup) runs right here: it needs only the committed tokens, which the
coordinator already holds, so a hop would cost more than the lookup.

The anchor is opaque here: a value in-process, an object-store reference when the
target is remote -- the coordinator passes it on without looking inside.
"""
from __future__ import annotations

from typing import Any, Hashable, NamedTuple, Sequence

from specserve.engine.config import AUTO_MODE_PREFERENCE, EngineConfig
from specserve.engine.errors import InvalidRequestError, ModelLoadError
from specserve.engine.grammar.compiler import grammar_compiler
from specserve.engine.model.tokenizer import TextTokenizer, encode_prompt
from specserve.engine.options import SPECULATIVE_MODES, GenerationOptions
from specserve.engine.sched.messages import PrefillItem, ProposeItem, ProposeResult, VerifyItem
from specserve.engine.speculative.proposers.base import NO_NEEDS, AcceptContext, Needs, Proposer
from specserve.engine.speculative.proposers.registry import PROPOSER_MODES
from specserve.engine.speculative.rounds import (Anchor, RoundOutcome, commit_outcome, drafts_allowed, proposer_context,
                                       record_round, tokens_left)
from specserve.engine.speculative.sequence import SequenceState, TokenCallback
from specserve.engine.speculative.stats import SpeculativeStats


class VerifiedRound(NamedTuple):
    num_drafts: int
    accepted: int
    committed: int
    draft_class: str = ""  # of its drafts (``Proposal.draft_class``)


class Speculation(NamedTuple):
    """A request's speculative decoding, resolved and checked (``DriverFactory.validate``)."""

    mode: str
    num_drafts: int  # most drafts per round: the request's num_speculative_tokens, or the engine's


# A verify pass lets draft i see window + i keys and evicts before rejected drafts are
# rewound, so speculation under a sliding window could change the output: refuse it.
WINDOW_REFUSAL = ("speculative decoding needs a full-attention KV cache to stay lossless; this engine has "
                  "sliding_window set, so only speculative_mode 'none' is available")


class SequenceDriver:
    def __init__(self, seq_id: Hashable, state: SequenceState, mode: str, num_drafts: int, needs: Needs,
                 local_proposer: Proposer | None = None, remote_proposer: bool = False, kv_tokens: int = 0,
                 adaptive: bool = False, prefix_caching: bool = False) -> None:
        self.seq_id, self.state, self.mode, self.num_drafts, self.needs = seq_id, state, mode, num_drafts, needs
        self.prefix_caching = prefix_caching
        self.cached_tokens = 0  # prompt tokens its first prefill found cached (OpenAI's ``cached_tokens``)
        self.kv_tokens = kv_tokens or len(state.tokens) + state.options.max_new_tokens  # KV to reserve
        self.adaptive = adaptive and mode != "none"  # its draft policy picks each round's drafts (<= num_drafts)
        self.local_proposer, self.remote_proposer = local_proposer, remote_proposer
        self.stats = SpeculativeStats(mode=mode)
        self.prefilled = False
        self.resuming = False
        self.anchor: Any = None
        self._proposer_has = 0          # committed tokens the remote proposer has seen
        self._last_accepted = -1
        self._drafts: list[int] = []
        self._probs: Any = None
        self.draft_class = ""  # of this round's drafts (``Proposal.draft_class``)
        self._closing = local_proposer is not None  # ``close`` has the local proposer to close

    @property
    def finished(self) -> bool:
        return self.state.finished

    @property
    def needs_prefill(self) -> bool:
        """The next target pass is a prefill: a new request, or one whose KV was lost."""
        return not self.prefilled or self.resuming

    # -- what to send --------------------------------------------------------------------
    def prefill_item(self, reserved_blocks: list[int] | None, prefix_blocks: int = 0) -> PrefillItem:
        """The prompt, or, after the sequence lost its target, every committed token;
        ``prefix_blocks``: how many leading reserved blocks already hold their KV."""
        return PrefillItem(self.seq_id, list(self.state.tokens), self.state.options, self.needs, reserved_blocks,
                           resume=self.resuming, rules=self.state.rules, prefix_blocks=prefix_blocks)

    @property
    def prefill_tokens(self) -> list[int]:
        """What the next prefill puts in the KV cache (``PrefillItem.fed``)."""
        return self.state.tokens[:-1] if self.resuming else list(self.state.tokens)

    @property
    def cache_query(self) -> list[int]:
        """The tokens admission looks up in the prefix cache: the next prefill's, unless
        caching is off or the request wants every prompt row's logprobs."""
        if not self.prefix_caching or (self.state.options.prompt_logprobs is not None and not self.prefilled):
            return []
        return self.prefill_tokens

    @property
    def final_tokens(self) -> list[int] | None:
        """The tokens whose KV is final on the target now -- every committed token but the
        pending one -- or None while it holds none for sure (before the first token, or
        after it lost its target)."""
        return self.state.tokens[:-1] if self.prefilled and not self.resuming else None

    def _drafts_this_round(self, num_drafts: int) -> int:
        """Most drafts this round may verify: the plan's ``num_drafts``, within the budget."""
        return drafts_allowed(self.state, num_drafts) if self.prefilled else 0

    def max_num_drafts(self) -> int:
        """Most drafts the scheduler may give this sequence's next round."""
        return 0 if self.mode == "none" or not self.prefilled else drafts_allowed(self.state, self.num_drafts)

    @property
    def ending(self) -> bool:
        """The next round can commit one token at most: the request's budget ends with it."""
        return self.prefilled and tokens_left(self.state) <= 1

    @property
    def proposer_seen(self) -> int:
        """Committed tokens the remote proposer has seen (0: none, or it lost them)."""
        return self._proposer_has

    def propose_item(self, num_drafts: int) -> ProposeItem | None:
        """The message for a remote proposer asking for up to ``num_drafts`` drafts this
        round, or None if no drafts are wanted."""
        self.no_drafts()
        num_drafts = self._drafts_this_round(num_drafts)
        if not self.remote_proposer or num_drafts == 0:
            return None
        tokens = self.state.tokens
        since = self._proposer_has
        self._proposer_has = len(tokens)
        return ProposeItem(self.seq_id, num_drafts, since, tokens[since:], None if since else self.state.options,
                           self._last_accepted if since else -1, self.anchor, None if since else self.state.rules)

    def propose_locally(self, num_drafts: int) -> bool:
        """Draft up to ``num_drafts`` with the in-coordinator (model-free) proposer, if this
        request has one; whether it looked (its lookups and hits count in the stats)."""
        self.no_drafts()
        num_drafts = self._drafts_this_round(num_drafts)
        if self.local_proposer is None or num_drafts == 0:
            return False
        state = self.state
        proposal = self.local_proposer.propose(
            proposer_context(num_drafts, state.tokens, state.options, Anchor(), None, state.rules))
        self._drafts = [int(t) for t in proposal.tokens[:num_drafts]]
        self.draft_class = proposal.draft_class if self._drafts else ""
        self.stats.record_lookup(bool(self._drafts))
        return True

    @property
    def drafted(self) -> int:
        """Drafts this round holds so far."""
        return len(self._drafts)

    def keep_drafts(self, num_drafts: int) -> None:
        """Verify only the first ``num_drafts`` of this round's drafts."""
        self._drafts = self._drafts[:num_drafts]
        if self._probs is not None:
            self._probs = self._probs[:num_drafts]

    def no_drafts(self) -> None:
        """This round verifies no drafts (its proposer is unavailable)."""
        self._drafts, self._probs, self.draft_class = [], None, ""

    def take_proposal(self, result: ProposeResult) -> None:
        if result.resync:
            self._proposer_has = 0  # send everything next round; this round has no drafts
            self.no_drafts()
            return
        self._drafts, self._probs = list(result.tokens), result.probs

    def verify_item(self, steps: int = 1, anchor: bool = True) -> VerifyItem:
        """This round's verify message. Without drafts, ``steps`` > 1 asks the target for
        that many plain rounds back to back (it feeds its own tokens), within the request's
        budget; ``anchor``: whether the call brings back what the proposer starts from next
        (always, for a proposer that takes none: it costs nothing)."""
        steps = min(steps, tokens_left(self.state)) if steps > 1 and not self._drafts else 1
        return VerifyItem(self.seq_id, list(self._drafts), self._probs, steps,
                          anchor=anchor or not self.needs.takes_anchor)

    # -- what came back ------------------------------------------------------------------
    def complete(self, outcome: RoundOutcome, anchor: Any, more: Sequence[RoundOutcome] = ()) -> list[VerifiedRound]:
        """Commit a round's (or the prefill's) outcome, then the plain rounds that followed
        it in the same target call (``more``), until the request finishes; returns what
        each verify round did (nothing for a prefill or a resume), for the metrics.
        ``anchor``: what the proposer starts from next, or an empty one (or None) where
        the call brought none back."""
        self.anchor = None if anchor is None or (isinstance(anchor, Anchor) and anchor.empty) else anchor
        if self.resuming:
            self.resuming = False
            return []
        if not self.prefilled:
            self.state.prompt_logprobs = outcome.prompt_logprobs  # before the first token's event
            commit_outcome(self.state, outcome)
            self.prefilled = True
            return []
        rounds = [self._commit(outcome, len(self._drafts), self.draft_class)]
        for step in more:  # plain rounds: no drafts
            if self.finished:
                break
            rounds.append(self._commit(step, 0))
        return rounds

    def _commit(self, outcome: RoundOutcome, num_drafts: int, draft_class: str = "") -> VerifiedRound:
        """Commit one verify round that checked ``num_drafts`` drafts: the tokens, the stats
        and what the in-coordinator proposer learns."""
        committed = commit_outcome(self.state, outcome)
        record_round(self.stats, num_drafts, outcome.accepted, committed)
        self._last_accepted = outcome.accepted
        if self.local_proposer is not None:
            self.local_proposer.accept(AcceptContext(outcome.accepted, outcome.tokens[:committed],
                                                     list(self.state.tokens)))
        return VerifiedRound(num_drafts, outcome.accepted, committed, draft_class)

    def close(self) -> None:
        """The request has ended: its in-coordinator proposer hears it, once (a suffix
        proposer gives its output to the coordinator's cache)."""
        proposer, self._closing = (self.local_proposer if self._closing else None), False
        if proposer is not None:
            proposer.close()

    def lost_target(self) -> None:
        """The target holding this sequence's KV is gone: re-prefill what is committed."""
        self.resuming = self.prefilled
        self._proposer_has = 0
        self.no_drafts()


def served_modes(model_modes) -> list[str]:
    """Every mode a deployment serves, given the model-based kinds it loaded: target-only
    and the kinds that run inside the coordinator are always served."""
    return [m for m in SPECULATIVE_MODES if m == "none" or m in model_modes
            or (m in PROPOSER_MODES and PROPOSER_MODES[m].in_coordinator)]


def resolve_default_mode(config: EngineConfig, modes: Sequence[str]) -> str:
    """The mode of a request that names none. ``"auto"`` picks the best loaded head;
    an explicit default that is not served, or speculation under a sliding window, is a
    load error (the deployment cannot serve its own default)."""
    wanted = config.speculative.default_mode
    if wanted == "auto":
        if config.sliding_window is not None:
            return "none"
        return next((m for m in AUTO_MODE_PREFERENCE if m in modes), "none")
    if wanted not in modes:
        raise ModelLoadError(f"default speculative mode '{wanted}' is not available (loaded: {', '.join(modes)})")
    if wanted != "none" and config.sliding_window is not None:
        raise ModelLoadError(WINDOW_REFUSAL)
    return wanted


class DriverFactory:
    """Turns a request into a ``SequenceDriver``: picks the mode, checks it is served,
    builds the committed-token state and says how much KV to reserve. The in-process
    engine and the server's router both make their drivers here, so mode resolution,
    the sliding-window refusal and the reservation size exist once."""

    def __init__(self, tokenizer: TextTokenizer, eos_token_ids: Sequence[int], max_context: int, vocab_size: int,
                 config: EngineConfig, served: dict[str, Needs]) -> None:
        """``served``: the model-based modes that have a proposer worker, and what each
        takes from the target; modes that run in the coordinator are always served."""
        self.tokenizer, self.eos_token_ids, self.max_context = tokenizer, tuple(eos_token_ids), max_context
        self.vocab_size, self.config, self.served = vocab_size, config, dict(served)
        self.speculative = config.speculative
        self.default_mode = resolve_default_mode(config, self.modes)
        # What a model-free kind's proposers share across this factory's requests (the
        # suffix cache): one per coordinator, so per engine, or per router replica.
        self.coordinator_states: dict[str, object | None] = {}

    @property
    def modes(self) -> list[str]:
        return served_modes(self.served)

    def reset_suffix_cache(self) -> int:
        """Forget earlier requests' outputs (the suffix cache), so the next requests run
        cold: for benchmarks. Returns how many outputs it held."""
        cache = self.coordinator_states.get("suffix")
        held = len(cache) if cache is not None else 0
        if cache is not None:
            cache.clear()
        return held

    def validate(self, options: GenerationOptions) -> Speculation:
        """Check a request's options against this deployment -- its mode is served (and
        allowed beside a sliding window), its token ids are in the vocabulary, its
        structured output's grammar compiles -- and resolve its speculation. Raises
        ``InvalidRequestError`` naming the option."""
        speculation = self._resolve_mode(options)
        self._check_token_ids(options)
        if options.structured_output is not None:  # a bad schema is the request's error, found before admission
            grammar_compiler(self.tokenizer, self.vocab_size, self.eos_token_ids).check(options.structured_output)
        return speculation

    def _resolve_mode(self, options: GenerationOptions) -> Speculation:
        mode = options.speculative_mode or self.default_mode
        if mode != "none" and self.config.sliding_window is not None:
            raise InvalidRequestError(WINDOW_REFUSAL, param="speculative_mode")
        if mode not in self.modes:
            raise InvalidRequestError(f"speculative mode '{mode}' is not loaded "
                                      f"(available: {', '.join(self.modes)})", param="speculative_mode")
        kind = PROPOSER_MODES.get(mode)  # None: target-only
        default = kind.default_num_drafts(self.speculative) if kind else self.speculative.num_speculative_tokens
        return Speculation(mode, options.num_speculative_tokens or default)

    def _check_token_ids(self, options: GenerationOptions) -> None:
        """The options' token ids (``stop_token_ids``, ``logit_bias``' keys) are in the vocabulary."""
        for param, ids in (("stop_token_ids", options.stop_token_ids),
                           ("logit_bias", [token for token, _ in options.logit_bias])):
            if any(i >= self.vocab_size for i in ids):
                raise InvalidRequestError(f"{param} must be token ids below the vocabulary size {self.vocab_size}",
                                          param=param)

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, self.vocab_size, self.max_context)

    def kv_reservation(self, prompt_len: int, max_new_tokens: int) -> int:
        """KV token slots to reserve for a request's worst case: every token it may hold,
        or, under a sliding window, the most blocks the window can ever keep at once."""
        tokens = min(prompt_len + max_new_tokens, self.max_context)
        window = self.config.sliding_window
        if window is None:
            return tokens
        size, sinks = self.config.kv_block_size, min(self.config.sink_tokens, window)
        held_blocks = -(-sinks // size) + -(-(window - sinks) // size) + 1
        return min(tokens, held_blocks * size)

    def create(self, seq_id: Hashable, prompt_ids: list[int], options: GenerationOptions,
               on_token: TokenCallback | None = None, speculation: Speculation | None = None) -> SequenceDriver:
        """A driver for one sequence. ``speculation``: what ``validate`` made of these
        options, where the caller validated them before (the router answers a bad request
        before it admits any of its choices); None validates them here."""
        mode, num_drafts = speculation or self.validate(options)
        state = SequenceState(prompt_ids, options, self.tokenizer, self.eos_token_ids, self.max_context, on_token)
        kind = PROPOSER_MODES.get(mode)
        # A seed asks for a reproducible sample, and a sampled round's random draws depend
        # on the drafts it verifies -- which adapting ties to measured timings, and a cache
        # shared across requests to what ran before. So a seeded sampled request keeps its
        # draft count unless it asks to adapt, and drafts from nothing other requests left.
        reproducible = not options.greedy and options.seed is not None
        local = None
        if kind is not None and kind.in_coordinator:
            if mode not in self.coordinator_states:
                self.coordinator_states[mode] = kind.coordinator_state(self.speculative)
            shared = None if reproducible else self.coordinator_states[mode]
            local = kind.local_proposer(self.speculative, num_drafts, len(prompt_ids), shared)
        adaptive = options.adaptive_speculation
        if adaptive is None:
            adaptive = self.speculative.adaptive and not reproducible
        return SequenceDriver(seq_id, state, mode, num_drafts, self.served.get(mode, NO_NEEDS), local,
                              remote_proposer=mode in self.served,
                              kv_tokens=self.kv_reservation(len(prompt_ids), options.max_new_tokens),
                              adaptive=adaptive, prefix_caching=self.config.caches_prefixes)
