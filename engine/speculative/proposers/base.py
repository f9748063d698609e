"""The proposer protocol: every source of draft tokens looks the same to the round loop.

Mirrors the ``SpeculativeProposer`` trait of ``speculative.rs``, the Rust speculative-decoding engine
specserve reimplements (each proposer here behaves as one of its proposers): ``propose`` drafts tokens for one verify
pass, ``accept`` hears what the target committed, ``rewind`` re-aligns private state to
the target's committed tokens, ``name`` identifies the mode. ``close`` releases
per-request resources (a draft model's KV blocks). ``propose_batch`` drafts for several
sequences at once; ``batchable`` modes do it with one model run per draft step for the
whole batch (the heads restart every pass; the draft model drafts into each sequence's
own instance, its ``owners``), the others loop.

Token convention (one target pass per round): ``context_tokens`` are the committed
tokens; the last of them (the *pending* token, the target's own choice) is not in the
target's KV cache yet: the *guaranteed* token, which the round commits whatever the
drafts (``ProposerContext.guaranteed_token``). Proposals hold
only the drafts that follow it, at most ``num_drafts`` of them. Under a structured
output a model-based proposer drafts only tokens its grammar allows
(``ProposerContext.grammar``, ``engine/grammar/drafting.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from specserve.engine.grammar.drafting import DraftGuide
from specserve.engine.options import GenerationOptions
from specserve.engine.speculative.sampling import SequenceRules


@dataclass(frozen=True)
class SharedKvSlice:
    """One group's slice of the target KV cache, from the one target layer bound to it."""

    group: str
    layer: int
    key: np.ndarray    # [1, kv_heads_of_layer, kv_len, head_dim_of_layer]
    value: np.ndarray

    @property
    def kv_heads(self) -> int:
        return self.key.shape[1]

    @property
    def head_dim(self) -> int:
        return self.key.shape[3]

    @property
    def kv_len(self) -> int:
        return self.key.shape[2]


@dataclass(frozen=True)
class ProposerContext:
    num_drafts: int                              # most drafts this round may verify
    context_tokens: Sequence[int]                # prompt + generated; last = pending/guaranteed token
    options: GenerationOptions
    target_hidden: np.ndarray | None = None      # [H] final hidden at the last position in the target KV
    target_hidden_layers: tuple[np.ndarray, ...] | None = None  # low, mid, high [H] each
    shared_kv: tuple[SharedKvSlice, ...] | None = None
    rng: np.random.Generator | None = None       # the request's generator, for sampling drafters
    rules: SequenceRules | None = None           # the sequence's logit rules (None: process as all prompt)
    grammar: DraftGuide | None = None            # a constrained output's grammar, to draft only what it allows

    @property
    def guaranteed_token(self) -> int:
        return int(self.context_tokens[-1])

    def kept(self, drafts: list[int]) -> list[int]:
        """The drafts a proposal returns: at most ``num_drafts``, none past where the
        grammar stopped them."""
        drafts = drafts[: self.num_drafts]
        return self.grammar.keep(drafts) if self.grammar is not None else drafts

    @property
    def width(self) -> int:
        """Most tokens this round may commit: its drafts and the target's own token."""
        return self.num_drafts + 1


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]
    # Draft distribution q of each token ([len(tokens), V]) when the proposer sampled
    # from one; None means the tokens were chosen greedily (one-hot q).
    probs: np.ndarray | None = None
    # What kind of draft this is, where a proposer knows drafts of one kind are accepted
    # alike (suffix decoding: by match length): the adaptive planner estimates each class's
    # acceptance apart. "" = unclassed.
    draft_class: str = ""


@dataclass(frozen=True)
class AcceptContext:
    accepted_prefix_len: int         # drafts the target accepted this round
    committed_tokens: Sequence[int]  # tokens committed this round (accepted drafts + correction/bonus)
    target_tokens: Sequence[int]     # all committed tokens after the round


@runtime_checkable
class Proposer(Protocol):
    name: str
    batchable: bool  # True: ``propose_batch`` drafts for a group of sequences with one model run per step

    def propose(self, context: ProposerContext) -> Proposal: ...

    def propose_batch(self, contexts: Sequence[ProposerContext],
                      owners: Sequence["Proposer"] | None = None) -> list[Proposal]:
        """``owners[i]``: the instance that holds ``contexts[i]``'s sequence (a kind that
        keeps per-sequence state drafts into each owner's; one that keeps none ignores it)."""

    def accept(self, context: AcceptContext) -> None: ...

    def rewind(self, target_tokens: Sequence[int]) -> None: ...

    def close(self) -> None: ...


class StatelessProposer:
    """Defaults for proposers that keep nothing between rounds."""

    name = "stateless"
    batchable = False

    def propose(self, context: ProposerContext) -> Proposal:
        raise NotImplementedError

    def propose_batch(self, contexts: Sequence[ProposerContext], owners=None) -> list[Proposal]:
        return [self.propose(context) for context in contexts]

    def accept(self, context: AcceptContext) -> None:
        return None

    def rewind(self, target_tokens: Sequence[int]) -> None:
        return None

    def close(self) -> None:
        return None


@dataclass(frozen=True)
class Needs:
    """What the round loop must hand a proposer mode (so it computes nothing unneeded)."""

    final_hidden: str | None = None                   # target output name of the final hidden state
    layer_hiddens: tuple[str, ...] = ()               # target output names, low/mid/high in order
    shared_kv_layers: dict[str, int] = field(default_factory=dict)  # group -> bound target layer

    @property
    def takes_anchor(self) -> bool:
        """Whether the proposer starts each round from the target's anchor (a head)."""
        return bool(self.final_hidden or self.layer_hiddens or self.shared_kv_layers)


NO_NEEDS = Needs()  # target-only decoding and model-free proposers take nothing from the target
