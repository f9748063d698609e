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
    def _lines(self) -> dict[int, tuple[float, float, float]]:
        """Per measured batch size: (rows at the first point, its seconds, seconds per row)."""
        lines = {}
        for batch in sorted({b for b, _ in self.seconds}):
            points = sorted((r, s) for (b, r), s in self.seconds.items() if b == batch)
            (r0, s0), (r1, s1) = points[0], points[-1]
            lines[batch] = (r0, s0, (s1 - s0) / (r1 - r0) if r1 > r0 else 0.0)
        return lines

    def _at(self, batch: int, rows: float) -> float:
        """Linear in rows between the measured points of one measured batch size."""
        r0, s0, slope = self._lines[batch]
        return s0 + slope * (rows - r0)

    def predict(self, batch: int, rows: int) -> float:
        """Interpolate between measured batch sizes at the same rows per sequence;
        beyond the largest, scale it linearly (a CPU pass at that size is compute-bound)."""
        batches = list(self._lines)
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
