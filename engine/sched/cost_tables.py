"""Measured cost tables: what one target verify call and one proposer call cost, by
batch size and rows or drafts, as the workers time them at start-up
(``sched.calibration``). The online models of ``sched.cost_models`` correct them.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class VerifyCostTable:
    """Seconds of one target call by (sequences, total rows), measured."""

    seconds: dict[tuple[int, int], float]

    @cached_property
    def _points(self) -> dict[int, list[tuple[int, float]]]:
        """Per measured batch size: its (total rows, seconds) points, by rows."""
        points: dict[int, list[tuple[int, float]]] = {}
        for (batch, rows), seconds in sorted(self.seconds.items()):
            points.setdefault(batch, []).append((rows, seconds))
        return points

    def _at(self, batch: int, rows: float) -> float:
        """Piecewise linear in rows through the measured points of one measured batch size,
        extended beyond them by the nearest segment. Not one line through the ends: at
        batch 1 a single row runs the step graph and two rows already the verify graph, a
        jump that a line from 1 to 5 rows would spread over every draft count
        (``sched.calibration``)."""
        points = self._points[batch]
        if len(points) == 1:
            return points[0][1]
        i = next((i for i in range(1, len(points) - 1) if rows <= points[i][0]), len(points) - 1)
        (r0, s0), (r1, s1) = points[i - 1], points[i]
        return s0 + (s1 - s0) / (r1 - r0) * (rows - r0)

    def predict(self, batch: int, rows: int) -> float:
        """Interpolate between measured batch sizes at the same rows per sequence;
        beyond the largest, scale it linearly (a CPU pass at that size is compute-bound)."""
        batches = list(self._points)
        per_seq = rows / max(batch, 1)
        if batch <= batches[0]:
            return self._at(batches[0], per_seq * batches[0]) * batch / batches[0]
        if batch >= batches[-1]:
            return self._at(batches[-1], per_seq * batches[-1]) * batch / batches[-1]
        upper = next(b for b in batches if b >= batch)
        lower = max(b for b in batches if b <= batch)
        if upper == lower:
            return self._at(lower, rows)
        w = (batch - lower) / (upper - lower)
        return (1 - w) * self._at(lower, per_seq * lower) + w * self._at(upper, per_seq * upper)


@dataclass(frozen=True)
class DraftCostTable:
    """Seconds of one proposer call by (sequences, drafts each), measured at (1, 1),
    (1, 4), (N, 1) and (N, 4)."""

    seconds: dict[tuple[int, int], float]

    def coefficients(self) -> tuple[float, float, float, float]:
        """(per call, per sequence, per step, per sequence-step) solving the four points
        exactly (bilinear in sequences and drafts), clamped at 0 against timing noise."""
        n = max(b for b, _ in self.seconds)
        t11, t14 = self.seconds[(1, 1)], self.seconds[(1, 4)]
        tn1, tn4 = self.seconds.get((n, 1), t11 * n), self.seconds.get((n, 4), t14 * n)
        per_seq_step = max(0.0, ((tn4 - tn1) - (t14 - t11)) / (3 * (n - 1))) if n > 1 else (t14 - t11) / 3
        per_step = max(0.0, (t14 - t11) / 3 - per_seq_step)
        per_seq = max(0.0, (tn1 - t11) / (n - 1) - per_seq_step) if n > 1 else 0.0
        per_call = max(0.0, t11 - per_seq - per_step - per_seq_step)
        return per_call, per_seq, per_step, per_seq_step
