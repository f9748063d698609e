"""Where the scheduler reports what it measures and what went wrong without failing a
request. The default records nothing but keeps counts, so tests and the in-process
engine can read them; the Ray Serve router plugs in Prometheus-backed metrics
(``deployments/metrics.py``)."""
from __future__ import annotations

from collections import Counter


class RoundMetrics:
    def __init__(self) -> None:
        self.faults: Counter[str] = Counter()  # swallowed failures by kind: never silent, always counted
        self.prefix_cache_queries = self.prefix_cache_hits = 0  # tokens looked up, and found cached

    def prefix_cache(self, queried: int, hit: int) -> None:
        """One admission's prefix-cache lookup, in tokens (vLLM's ``prefix_cache_queries``
        and ``prefix_cache_hits``)."""
        self.prefix_cache_queries += queried
        self.prefix_cache_hits += hit

    def draft_call(self, mode: str, seconds: float) -> None: ...

    def verify_call(self, seconds: float) -> None: ...

    def tick(self, seconds: float, active: int) -> None: ...

    def verify_round(self, mode: str, num_drafts: int, accepted: int, committed: int) -> None: ...

    def draft_lookup(self, mode: str, found: bool) -> None:
        """One lookup of a model-free proposer (prompt lookup, suffix): whether it found drafts."""

    def draft_length(self, mode: str, num_drafts: int) -> None:
        """The number of drafts adaptive speculation chose for one sequence's round."""

    def fault(self, kind: str, mode: str = "") -> None:
        """A failure the scheduler recovered from (the request went on): ``kind`` is one of
        ``proposer_failed``, ``proposer_timeout``, ``propose_batch_failed``,
        ``ledger_release_failed``, ``ledger_publish_failed`` (a finished prefill's blocks
        not shared), ``target_lost`` (a sequence re-prefilled elsewhere)."""
        self.faults[kind] += 1
