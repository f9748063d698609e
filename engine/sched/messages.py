"""The messages between the round coordinator and the workers, for both transports.

In-process they are handed over as objects; on the server they are what a router's
plain actor call carries to a target or proposer worker and back (``deployments/``), so
every field is small: token ids, counts, options, and object-store references for
anything large (draft distributions, hidden-state anchors).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable

from specserve.engine.options import GenerationOptions
from specserve.engine.speculative.proposers.base import Needs
from specserve.engine.speculative.rounds import RoundOutcome
from specserve.engine.speculative.sampling import SequenceRules


# -- coordinator -> target worker, and back ----------------------------------------------
@dataclass(frozen=True)
class PrefillItem:
    """Start (or, with ``resume``, restore) a sequence on this target.

    A resume re-feeds committed tokens after the sequence lost its KV (e.g. its target
    replica died): it rebuilds KV and anchor and commits nothing new."""

    seq_id: Hashable
    tokens: list[int]            # prompt (or, when resuming, every committed token)
    options: GenerationOptions
    needs: Needs = field(default_factory=Needs)
    reserved_blocks: list[int] | None = None
    resume: bool = False
    rules: SequenceRules | None = None  # None: ``tokens`` is the prompt (rules from the options and the EOS)
    prefix_blocks: int = 0  # leading ``reserved_blocks`` that hold the prefix's KV already (a prefix-cache hit)

    @property
    def fed(self) -> list[int]:
        """The tokens whose KV the prefill puts in the cache: the prompt, or for a resume
        every committed token but the pending one."""
        return self.tokens[:-1] if self.resume else self.tokens

@dataclass(frozen=True)
class VerifyItem:
    seq_id: Hashable
    drafts: list[int]
    probs: Any = None            # draft distribution [k, V] (or an object-store reference to it)
    steps: int = 1               # plain rounds to run back to back (no drafts): ``_more_steps``
    anchor: bool = True          # bring back the anchor the proposer starts from next (False: the caller's
                                 # plan drafts nothing for it next round; on the server it would cost a put)

@dataclass(frozen=True)
class TargetResult:
    seq_id: Hashable
    outcome: RoundOutcome | None  # None on error
    more: tuple[RoundOutcome, ...] = ()  # the plain rounds that followed it in the same call
    kv_length: int = 0            # tokens in the sequence's KV after the round
    error: str | None = None
    unknown_sequence: bool = False  # this target does not hold the sequence: re-prefill it
    merged_call: bool = False     # its call ran with another router's sequences: the time was not its own


# -- coordinator -> proposer worker, and back --------------------------------------------
@dataclass(frozen=True)
class ProposeItem:
    seq_id: Hashable
    num_drafts: int             # most drafts the round may verify
    since: int                  # index in the committed tokens where ``new_tokens`` start
    new_tokens: list[int]       # committed tokens the worker has not seen yet
    options: GenerationOptions | None  # sent with the whole context only (since == 0)
    accepted: int = -1          # drafts the target accepted last round (-1: no round yet)
    anchor: Any = None          # an ``Anchor``, or an object-store reference the transport resolves
    rules: SequenceRules | None = None  # the sequence's logit rules, sent with the options

@dataclass(frozen=True)
class ProposeResult:
    seq_id: Hashable
    tokens: list[int]
    probs: Any = None           # draft distribution [len(tokens), V], or a reference to it
    resync: bool = False        # the worker lacks this sequence's tokens: send them all next time
    error: str | None = None
