"""Speculative statistics, per request and cumulative: the four counters of
``speculative.rs`` (verification steps, proposed, accepted and multi-token
accepts), plus acceptance per draft position and the mean accepted length tau."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpeculativeStats:
    mode: str = "none"
    verification_steps: int = 0      # target verify passes (rounds)
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    multi_token_accepts: int = 0     # rounds that accepted >= 2 drafts (as ``speculative.rs`` counts them)
    committed_tokens: int = 0        # tokens committed by rounds (accepted drafts + corrections/bonuses)
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    lookups: int = 0                 # rounds a model-free proposer looked for drafts
    lookup_hits: int = 0             # ... and found some

    def record_lookup(self, found: bool) -> None:
        self.lookups += 1
        self.lookup_hits += found

    @property
    def hit_rate(self) -> float:
        """The share of a model-free proposer's lookups that found drafts."""
        return self.lookup_hits / self.lookups if self.lookups else 0.0

    def record_round(self, proposed: int, accepted: int, committed: int) -> None:
        self.verification_steps += 1
        self.proposed_tokens += proposed
        self.accepted_tokens += accepted
        self.committed_tokens += committed
        self.multi_token_accepts += accepted >= 2
        for counts, upto in ((self.proposed_per_position, proposed), (self.accepted_per_position, accepted)):
            counts.extend([0] * (upto - len(counts)))
            for i in range(upto):
                counts[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_per_position, self.proposed_per_position)]

    @property
    def mean_accepted_length(self) -> float:
        """tau: tokens committed per target verification pass (1.0 = no speedup)."""
        return self.committed_tokens / self.verification_steps if self.verification_steps else 0.0

    def merge(self, other: "SpeculativeStats") -> None:
        self.verification_steps += other.verification_steps
        self.proposed_tokens += other.proposed_tokens
        self.accepted_tokens += other.accepted_tokens
        self.multi_token_accepts += other.multi_token_accepts
        self.committed_tokens += other.committed_tokens
        self.lookups += other.lookups
        self.lookup_hits += other.lookup_hits
        for mine, theirs in ((self.proposed_per_position, other.proposed_per_position),
                             (self.accepted_per_position, other.accepted_per_position)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, value in enumerate(theirs):
                mine[i] += value
