"""Live acceptance of each draft position, per sequence and per mode: what the
draft-length planner (``sched.draft_length``) expects a draft to earn.

A position is judged only in rounds whose drafts before it were all accepted, so each
estimate is conditional on reaching its position. A sequence with few rounds borrows
its mode's average, and a mode with few rounds an optimistic prior, so that a new
mode gets tried and one early rejection does not sink a position for good.
"""
from __future__ import annotations

from dataclasses import dataclass, field

PRIOR_ACCEPTANCE = 0.7   # a mode's acceptance before it has any rounds: optimistic, so it gets tried
MODE_PRIOR_WEIGHT = 4.0  # rounds' worth of weight that prior keeps in a mode's average: one early
                         # rejection must not sink a position the mode then never drafts again
PRIOR_WEIGHT = 8.0       # rounds' worth of weight the mode average keeps in a sequence's estimate
MODE_DECAY = 0.995       # per recorded round: a mode's average follows the current traffic


@dataclass
class _Counts:
    tested: list[float] = field(default_factory=list)   # rounds that reached position i (drafts < i all accepted)
    passed: list[float] = field(default_factory=list)   # ... and accepted it

    def record(self, num_drafts: int, accepted: int, decay: float = 1.0) -> None:
        if decay != 1.0:
            self.tested = [t * decay for t in self.tested]
            self.passed = [p * decay for p in self.passed]
        grow = num_drafts - len(self.tested)
        if grow > 0:
            self.tested.extend([0.0] * grow)
            self.passed.extend([0.0] * grow)
        for i in range(min(num_drafts, accepted + 1)):  # positions the target actually judged
            self.tested[i] += 1
            self.passed[i] += i < accepted


_NO_COUNTS = _Counts()  # read only: what a sequence or mode without rounds has


class AcceptanceTracker:
    """Per-sequence and per-mode acceptance of each draft position, conditional on the
    drafts before it being accepted (the only way a position is ever judged).

    A proposer may say which *class* its round's drafts belong to (``Proposal.draft_class``:
    suffix decoding's match length), when drafts of one class are accepted alike and
    classes differ: a round then counts in its class and in its mode's overall counts, and
    a plan for a classed draft reads its class's (docs/adaptive-speculation.md)."""

    def __init__(self) -> None:
        self._modes: dict[tuple[str, str], _Counts] = {}
        self._seqs: dict[object, dict[str, _Counts]] = {}

    def record(self, seq_id, mode: str, num_drafts: int, accepted: int, draft_class: str = "") -> None:
        if num_drafts <= 0:
            return
        own = self._seqs.setdefault(seq_id, {})
        for kind in {"", draft_class}:
            self._modes.setdefault((mode, kind), _Counts()).record(num_drafts, accepted, MODE_DECAY)
            own.setdefault(kind, _Counts()).record(num_drafts, accepted)

    def forget(self, seq_id) -> None:
        self._seqs.pop(seq_id, None)

    def alphas(self, seq_id, mode: str, max_num_drafts: int, draft_class: str = "") -> list[float]:
        """Each position's estimate: the sequence's own counts, shrunk toward its mode's
        average (itself shrunk toward ``PRIOR_ACCEPTANCE``), each ``(passed + weight *
        prior) / (tested + weight)``; of ``draft_class`` where one is given."""
        mode_counts = self._modes.get((mode, draft_class), _NO_COUNTS)
        own = self._seqs.get(seq_id, {}).get(draft_class, _NO_COUNTS)
        mode_tested, mode_passed, tested, passed = mode_counts.tested, mode_counts.passed, own.tested, own.passed
        known_mode, known = len(mode_tested), len(tested)
        rates = []
        for i in range(max_num_drafts):
            prior = (((mode_passed[i] if i < known_mode else 0.0) + MODE_PRIOR_WEIGHT * PRIOR_ACCEPTANCE)
                     / ((mode_tested[i] if i < known_mode else 0.0) + MODE_PRIOR_WEIGHT))
            rates.append(((passed[i] if i < known else 0.0) + PRIOR_WEIGHT * prior)
                         / ((tested[i] if i < known else 0.0) + PRIOR_WEIGHT))
        return rates


LOOKUP_PRIOR_FIND = 0.5  # how often a looking proposer finds drafts, before it has looked: optimistic,
                         # so a sequence keeps its one-round calls until its lookups have said otherwise
LOOKUP_PRIOR_DRAFTS = 2.0  # drafts it finds when it finds some, before it has found any


@dataclass
class _Lookups:
    looked: float = 0.0
    found: float = 0.0
    drafts: float = 0.0  # drafts found, over the lookups that found some

    def record(self, found: int, decay: float = 1.0) -> None:
        self.looked, self.found, self.drafts = self.looked * decay + 1, self.found * decay, self.drafts * decay
        if found:
            self.found += 1
            self.drafts += found


class LookupTracker:
    """How often a proposer that looks its drafts up before the plan (prompt lookup, in
    the coordinator) finds some, and how many: per sequence, shrunk toward its mode's
    average as ``AcceptanceTracker`` shrinks acceptance. What a round that may look again
    is worth, against several plain rounds in one call that do not look."""

    def __init__(self) -> None:
        self._modes: dict[str, _Lookups] = {}
        self._seqs: dict[object, _Lookups] = {}

    def record(self, seq_id, mode: str, found: int) -> None:
        self._modes.setdefault(mode, _Lookups()).record(found, MODE_DECAY)
        self._seqs.setdefault(seq_id, _Lookups()).record(found)

    def forget(self, seq_id) -> None:
        self._seqs.pop(seq_id, None)

    def odds(self, seq_id, mode: str) -> tuple[float, float]:
        """(probability a lookup finds drafts, drafts it finds when it does)."""
        mode_counts, own = self._modes.get(mode, _Lookups()), self._seqs.get(seq_id, _Lookups())
        mode_find = ((mode_counts.found + MODE_PRIOR_WEIGHT * LOOKUP_PRIOR_FIND)
                     / (mode_counts.looked + MODE_PRIOR_WEIGHT))
        mode_drafts = ((mode_counts.drafts + MODE_PRIOR_WEIGHT * LOOKUP_PRIOR_DRAFTS)
                       / (mode_counts.found + MODE_PRIOR_WEIGHT))
        find = (own.found + PRIOR_WEIGHT * mode_find) / (own.looked + PRIOR_WEIGHT)
        drafts = (own.drafts + PRIOR_WEIGHT * mode_drafts) / (own.found + PRIOR_WEIGHT)
        return find, drafts
