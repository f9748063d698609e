"""What a call to a one-call-at-a-time worker cost its caller's plan, without the time it
queued behind another lane's call to the same worker.

Lanes (``SchedulerConfig.lanes``) overlap one lane's calls with another's, but each
worker runs one call at a time: a call sent while another lane's call to that worker is
running waits for it. The draft-length planner prices a round by what its calls cost;
taught with the wait included, it learns another lane's work as this plan's, and a plain
round that queued behind a multi-step call looks as dear as the whole of it
(docs/architecture.md). So a call counts from when it was sent or when the last call to
the same worker that finished while it was in flight finished, whichever is later: the
worker serves in order, so that is when it started on this one.
"""
from __future__ import annotations

import time
from typing import Hashable


class SerialCallClock:
    """Per worker, when its latest call finished (``perf_counter`` seconds)."""

    def __init__(self, clock=time.perf_counter) -> None:
        self._clock = clock
        self._finished: dict[Hashable, float] = {}

    def now(self) -> float:
        return self._clock()

    def finished(self, worker: Hashable, sent: float) -> tuple[float, float]:
        """A call to ``worker`` sent at ``sent`` finished now: its seconds, and those it
        cost beyond waiting for the worker's earlier calls. Records its finish."""
        finished = self._clock()
        served_from = max(sent, self._finished.get(worker, sent))
        self._finished[worker] = finished
        return finished - sent, finished - served_from
