"""The seam between the round coordinator and how many drafts each round verifies.

Each tick the coordinator asks its ``DraftPolicy`` to ``plan`` the tick's target calls
(the decoding sequences of each target replica) and, once the tick is over, hands it one
``TickReport`` of what the tick saw (``observe``). Neither the coordinator nor a
``SequenceDriver`` keeps anything of a policy's between ticks: a plan belongs to its
tick, and the driver gets its part as arguments when it builds the round's messages.

Two policies implement it:

- ``FixedDrafts``: every round drafts its maximum (the request's ``num_speculative_tokens``,
  within its budget); calls of target-only sequences run ``plain_steps`` rounds each.
- ``sched.adaptive_drafts.AdaptiveDrafts``: adaptive requests' drafts planned from measured
  costs and live acceptance (``sched.draft_length``); pinned requests as ``FixedDrafts``.

Token-tree sizing and new proposers plug in here rather than into the coordinator.
Whatever a policy plans, rounds stay lossless: it chooses how many drafts are verified,
never how.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, NamedTuple, Protocol, Sequence

from specserve.engine.sched.sequence_driver import SequenceDriver


@dataclass(frozen=True)
class RoundPlan:
    """One target call's plan: each sequence's draft count, in the call's order, how many
    plain rounds the call runs back to back (1 unless it drafts nothing), and for which
    sequences the call brings back the anchor their proposer starts from next round
    (None: every sequence's). Plans compare by their drafts and steps."""

    num_drafts: list[int]
    steps: int = 1
    anchors: list[bool] | None = field(default=None, compare=False)


# -- what a tick saw (``TickReport``) ---------------------------------------------------
class SequenceRound(NamedTuple):
    """A verify round of one sequence: how many drafts it checked, how many were accepted."""

    seq_id: object
    mode: str
    num_drafts: int
    accepted: int
    draft_class: str = ""  # of the drafts it verified (``Proposal.draft_class``)


class TargetCall(NamedTuple):
    """One target call and its seconds: each verified sequence's rows (its drafts + 1) and
    plain rounds asked for, and what else the call carried."""

    rows: list[int]
    steps: list[int]
    prefills: int
    sequences_changed: bool  # not the sequences of the replica's last call, or merged with another router's
    seconds: float


def tokens_behind(since: int, fed: int, num_drafts: int) -> int:
    """Tokens a remote proposer feeds beyond what one round commits, given where its view
    of the sequence ended (``since``, 0 at first contact or after a resync) and the
    committed tokens it is fed: the whole context at first contact, else what rounds
    without drafts committed (a round of ``num_drafts`` drafts commits up to that + 1)."""
    return fed if since == 0 else max(0, fed - (num_drafts + 1))


class ProposerCall(NamedTuple):
    """One proposer call that drafted for sequences, and its seconds: for each sequence its
    draft count, where its proposer's view began (``ProposeItem.since``), how many committed
    tokens the call fed, and the most drafts its request allows."""

    mode: str
    num_drafts: list[int]
    since: list[int]
    fed: list[int]
    max_num_drafts: list[int]
    seconds: float

    @property
    def catch_up_tokens(self) -> int:
        """Tokens fed beyond what the sequences' rounds committed (``tokens_behind``)."""
        return sum(map(tokens_behind, self.since, self.fed, self.max_num_drafts))


class RoundTime(NamedTuple):
    """A tick's seconds outside its proposer and target calls, and since its lane's last."""

    sequences: int    # decoding sequences
    prefills: int
    multi_step: bool  # some target call ran several plain rounds
    seconds: float
    gap: float | None = None  # seconds since the lane's previous tick ended, where it had work
                              # all along and that tick ran no prefill (``VerifyCostModel.observe_gap``)


@dataclass
class TickReport:
    """What one tick of a lane saw, in the order it happened: its proposer calls, its
    target calls, the rounds they verified, the sequences retired (since the last report:
    a request cancelled or failed between ticks is reported with the next), its time."""

    proposer_calls: list[ProposerCall] = field(default_factory=list)
    target_calls: list[TargetCall] = field(default_factory=list)
    rounds: list[SequenceRound] = field(default_factory=list)
    retired: list[Hashable] = field(default_factory=list)
    time: RoundTime | None = None


class DraftPolicy(Protocol):
    async def plan(self, calls: Sequence[Sequence[SequenceDriver]]) -> list[RoundPlan]:
        """One plan per target call of this tick, in order; each call's decoding sequences
        in the call's order. A sequence whose proposer runs in the coordinator has drafted
        its maximum already (``SequenceDriver.drafted``): its plan keeps at most those."""

    def observe(self, report: TickReport) -> None:
        """What the tick after the last plan saw."""


def most_drafts(driver: SequenceDriver) -> int:
    """The most drafts a sequence's round may verify now: what its in-coordinator proposer
    found, or what its remote proposer may be asked for."""
    return driver.drafted if driver.local_proposer is not None else driver.max_num_drafts()


class FixedDrafts:
    """Every round drafts its maximum; a call of target-only sequences runs ``plain_steps``
    plain rounds back to back (vLLM's num_scheduler_steps), paying its fixed part once."""

    def __init__(self, plain_steps: int = 1) -> None:
        self.plain_steps = plain_steps

    async def plan(self, calls: Sequence[Sequence[SequenceDriver]]) -> list[RoundPlan]:
        return [self.plan_call(call) for call in calls]

    def plan_call(self, call: Sequence[SequenceDriver]) -> RoundPlan:
        if all(driver.mode == "none" for driver in call):
            # Target-only rounds have nothing to wait for: several to a call. Never in a
            # call with a drafting sequence, which would wait for the others'.
            return RoundPlan([0] * len(call), self.plain_steps)
        return RoundPlan([most_drafts(driver) for driver in call])

    def observe(self, report: TickReport) -> None:
        pass  # nothing to learn
