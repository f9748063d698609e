"""Online cost models: the measured tables (``sched.cost_tables``), corrected by what
real calls cost, which is what adaptive speculation plans with.

``VerifyCostModel`` interpolates the target's table, corrects it by what real calls of
each kind cost per batch-size bucket (real pasts, hops, the machine's current load) and
adds what a round costs beyond its calls, so the in-process engine and the server each
plan with what a round costs *them*. ``DraftCostModel`` does the same for each proposer
kind's calls, and prices a draft model's catch-up.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

from specserve.engine.sched.cost_tables import DraftCostTable, VerifyCostTable
from specserve.engine.sched.verify_split import verify_groups


def load_bucket(sequences: int) -> int:
    """Corrections are learnt per batch-size bucket (1, 2-3, 4-7, 8-15, 16-31, 32-63, ...):
    what a call costs beyond the table at 32 sequences says nothing about 1."""
    return max(1, sequences).bit_length()


MIN_SLOPE, MAX_SLOPE = 0.5, 4.0  # real seconds per table second between plain and drafting calls
OUTLIER = 2.0  # once a kind has MIN_KIND_CALLS samples, one counts as at most this many times what
               # it predicts: one slow call (a hiccup of the machine), learnt whole, can price a
               # kind of call out, and then no call of that kind comes to correct it
OVERHEAD_FLOOR = 0.0005  # seconds: an overhead learnt near 0 may still grow by OUTLIER x this a sample
MIN_MULTI_STEP_CALLS = 2  # multi-step calls (several plain rounds in one) before they price such calls:
    # the prior below is optimistic (further rounds at the table's own figure; real pasts are
    # longer than the calibration's), and each call until then is a choice made on it (a call
    # of several rounds times steadier than a single round)
MIN_CATCH_UP_CALLS = 3  # proposer calls that carried catch-ups before their learnt price replaces the prior
MIN_KIND_CALLS, MIN_KIND_SHARE = 8, 0.05  # a kind of call rarer than this in its bucket is an odd one
    # (for a head that always drafts, a plain call is a sequence's first after its prefill, which
    # copies its past into the batch layout: learnt, it would price plain rounds far too dear)


class VerifyCostModel:
    """The measured table, corrected by what real calls of the same batch-size bucket
    cost, learnt online per kind of call: *plain* (one row per sequence) and *drafting*
    (padded to the widest sequence's drafts); plus what a round costs beyond its calls.

    A call's cost is a line in the table's prediction through the two kinds' means: real
    calls carry a fixed part per sequence (the worker's per-sequence verification work,
    a hop) that does not grow with rows, and a part that scales with the table (real
    pasts are longer than the calibration's, the machine's speed drifts). Priced only as
    an offset learnt from plain calls -- nearly every call at a large batch -- a padded
    drafting call comes out cheaper than it runs, and plans draft for whole batches where
    plain rounds are faster; priced only as a ratio, the fixed part makes plain calls
    look dear and drafting cheap. Until a bucket has seen enough of both kinds,
    the one it has seen scales the table. A call the target split (``verify_groups``) is not the
    padded call the planner prices, so it teaches neither kind."""

    def __init__(self, table: VerifyCostTable, smoothing: float = 0.1) -> None:
        self.table, self.smoothing = table, smoothing
        # (bucket, drafting) -> ((table seconds, real seconds) averaged, calls)
        self.calls: dict[tuple[int, bool], tuple[tuple[float, float], int]] = {}
        self.overheads: dict[int, tuple[tuple[float], int]] = {}  # bucket -> ((seconds,), rounds)
        self.gaps: dict[int, tuple[tuple[float], int]] = {}  # bucket -> ((seconds,), ticks): ``observe_gap``
        # bucket -> ((table seconds, real seconds) averaged, calls) of multi-step calls
        self.multi_step_calls: dict[int, tuple[tuple[float, float], int]] = {}
        # bucket -> its ``_kinds``, until the next call is learnt: a plan prices a dozen
        # calls of one bucket, and the kinds change only when a call is learnt
        self._known_kinds: dict[int, tuple] = {}

    def _kinds(self, batch: int):
        """The bucket's (plain, drafting) means, each None until seen often enough."""
        bucket = load_bucket(batch)
        known = self._known_kinds.get(bucket)
        if known is None:
            plain, drafting = self.calls.get((bucket, False)), self.calls.get((bucket, True))
            seen = sum(kind[1] for kind in (plain, drafting) if kind is not None)
            known = self._known_kinds[bucket] = tuple(
                kind if kind is not None and kind[1] >= max(MIN_KIND_CALLS, MIN_KIND_SHARE * seen) else None
                for kind in (plain, drafting))
        return known

    def _line(self, batch: int) -> tuple[float, float, float] | None:
        """(table seconds, real seconds, slope) of the line through the two kinds' means,
        once both are known and far enough apart to tell a slope."""
        plain, drafting = self._kinds(batch)
        if plain is not None and drafting is not None and drafting[0][0] > 1.2 * plain[0][0]:
            (t0, r0), (t1, r1) = plain[0], drafting[0]
            return t0, r0, min(MAX_SLOPE, max(MIN_SLOPE, (r1 - r0) / (t1 - t0)))
        return None

    def call(self, batch: int, rows: int) -> float:
        """Predicted seconds of one target call of ``batch`` sequences padded to ``rows``."""
        return self.call_prices(batch)(rows)

    def call_prices(self, batch: int) -> Callable[[int], float]:
        """``call`` at one batch size, as a function of rows, with the bucket's line and
        kinds looked up once: a plan prices each cap of its call at the same batch size."""
        table, line = self.table.predict, self._line(batch)
        if line is not None:
            t0, r0, slope = line
            return lambda rows: max(0.0, r0 + slope * (table(batch, rows) - t0))
        plain, drafting = self._kinds(batch)
        wide, narrow = (drafting or plain), (plain or drafting)

        def price(rows: int) -> float:
            seen = wide if rows > batch else narrow
            return table(batch, rows) * seen[0][1] / seen[0][0] if seen is not None else table(batch, rows)
        return price

    def plain_rounds(self, batch: int, steps: int) -> float:
        """Seconds of ``steps`` plain rounds of ``batch`` sequences run back to back in one
        target call (``scheduler.plain_steps``). The call: scaled from such calls of its
        bucket once seen; before, a plain call (its fixed part: a hop, the worker's own
        work) and each further round at the table's own figure, timed in the worker
        without a hop. (Not at the plain-to-drafting line's slope: at batch 1 a drafting
        call differs from a plain one mostly by its object-store traffic, not by rows, so
        through the server that slope would price further rounds several times too dear.)
        Plus every round's overhead: committing and streaming its tokens is paid per round,
        not per call, and counted once it would make plain rounds look cheaper than they run;
        and one gap between ticks (``gap``), which the call's rounds share."""
        table = self.table.predict(batch, batch)
        if self.knows_multi_step(batch):
            (mean_table, mean_real), _ = self.multi_step_calls[load_bucket(batch)]
            call = steps * table * mean_real / mean_table
        else:
            call = self.call(batch, batch) + (steps - 1) * table
        return call + steps * self.overhead(batch) + self.gap(batch)

    def knows_multi_step(self, batch: int) -> bool:
        """Whether ``plain_rounds`` at this batch size prices from multi-step calls it has
        seen, rather than from its prior."""
        seen = self.multi_step_calls.get(load_bucket(batch))
        return seen is not None and seen[1] >= MIN_MULTI_STEP_CALLS

    def overhead(self, batch: int) -> float:
        seen = self.overheads.get(load_bucket(batch))
        return seen[0][0] if seen is not None else 0.0

    def gap(self, batch: int) -> float:
        """Seconds a tick of ``batch`` sequences waits after its lane's previous one
        (``observe_gap``); 0 until seen."""
        seen = self.gaps.get(load_bucket(batch))
        return seen[0][0] if seen is not None else 0.0

    def predict(self, batch: int, rows: int) -> float:
        """Seconds of a round whose target call verifies ``batch`` sequences padded to
        ``rows`` rows: the call, what the round costs beyond its calls, and the gap before
        its tick."""
        return self.call(batch, rows) + self.overhead(batch) + self.gap(batch)

    def round_prices(self, batch: int) -> Callable[[int], float]:
        """``predict`` at one batch size, as a function of rows (``call_prices``)."""
        call, fixed = self.call_prices(batch), self.overhead(batch) + self.gap(batch)
        return lambda rows: call(rows) + fixed

    def observe(self, rows: Sequence[int], seconds: float, steps: int = 1) -> None:
        """One target call verifying sequences of these rows each (drafts + 1) took
        ``seconds``; ``steps`` > 1: a multi-step call of that many plain rounds, learnt
        apart (``plain_rounds``)."""
        if not rows or len(verify_groups(rows, self.table)) > 1:
            return
        widest = max(rows)
        table = self.table.predict(len(rows), len(rows) * widest)
        if steps > 1:
            _learn(self.multi_step_calls, load_bucket(len(rows)), (table * steps, seconds), self.smoothing)
            return
        key = (load_bucket(len(rows)), widest > 1)
        seen = self.calls.get(key)
        if seen is not None and seen[1] >= MIN_KIND_CALLS:
            (mean_table, mean_real), _ = seen
            seconds = min(seconds, OUTLIER * table * mean_real / mean_table)
        _learn(self.calls, key, (table, seconds), self.smoothing)
        self._known_kinds.pop(key[0], None)

    def observe_overhead(self, batch: int, seconds: float) -> None:
        """A round of ``batch`` sequences spent ``seconds`` outside its proposer and
        target calls: planning, committing and streaming what came back. One value per
        bucket, learnt from every round: kept per kind, a drafting overhead inflated once
        (a round at the tail of a busy run) would stop drafting, and rounds without drafts
        would never correct it."""
        _learn_bounded(self.overheads, load_bucket(batch), seconds, self.smoothing)

    def observe_gap(self, batch: int, seconds: float) -> None:
        """A tick of ``batch`` sequences started ``seconds`` after its lane's previous tick
        ended, the lane having work all along: the event loop's other work in between,
        paid once a tick whatever the tick ran. In-process that is next to nothing; on the
        server it is where the router streams the tokens out (SSE), a millisecond or more
        a tick (``bench/distributed.py``'s "outside the tick"), which a drafting round pays
        for its few tokens and a multi-step call once for all its rounds' -- unpriced,
        drafting through the server looks cheaper than it runs."""
        _learn_bounded(self.gaps, load_bucket(batch), seconds, self.smoothing)


def _learn_bounded(values: dict, bucket: int, seconds: float, smoothing: float) -> None:
    """``_learn`` a bucket's seconds, each sample at most ``OUTLIER`` times the mean once
    ``MIN_KIND_CALLS`` are in (a busy moment, learnt whole, would price drafting out, and
    rounds without drafts would be slow to correct it)."""
    seen = values.get(bucket)
    if seen is not None and seen[1] >= MIN_KIND_CALLS:
        seconds = min(seconds, OUTLIER * max(seen[0][0], OVERHEAD_FLOOR))
    _learn(values, bucket, (seconds,), smoothing)


def _learn(values: dict, key, sample: tuple[float, ...], smoothing: float) -> None:
    """A running mean for the first ``1 / smoothing`` samples, then an exponential one:
    a value far from the table is learnt in a few calls, and then follows the load."""
    previous, count = values.get(key, (sample, 0))
    weight = max(smoothing, 1.0 / (count + 1))
    values[key] = (tuple((1 - weight) * p + weight * x for p, x in zip(previous, sample)), count + 1)


class DraftCostModel:
    """Predicted seconds of a proposer call for a plan: a head (``heads``) restarts from
    the target's anchor every pass, so it runs ``steps`` (the longest draft count) steps
    over all ``n`` drafting sequences; a draft model steps each sequence to its own
    count, the ones done dropping out (``draft_tokens`` rows in all). The measured table
    per mode, plus the per-call overhead observed online (hops, load). A mode without a
    table costs nothing until measured, so it gets tried."""

    def __init__(self, heads: Iterable[str], smoothing: float = 0.1) -> None:
        self.coefficients: dict[str, tuple[float, float, float, float]] = {}
        self.heads, self.smoothing = frozenset(heads), smoothing  # modes whose proposer is a head
        self.overhead: dict[tuple[str, int], float] = {}  # (mode, batch-size bucket) -> learnt residual
        self.catch_ups: dict[str, tuple[tuple[float, float], int]] = {}  # mode -> ((tokens, seconds), calls)

    def add(self, mode: str, table: DraftCostTable) -> None:
        self.coefficients[mode] = table.coefficients()

    def marginal_step(self, mode: str) -> float:
        """Seconds one more draft of one sequence adds (a draft model's step)."""
        return self.coefficients[mode][3] if mode in self.coefficients else 0.0

    def _table(self, mode: str, n: int, steps: int, draft_tokens: int) -> float:
        per_call, per_seq, per_step, per_seq_step = self.coefficients[mode]
        work = n * steps if mode in self.heads else draft_tokens
        return per_call + n * per_seq + steps * per_step + work * per_seq_step

    def predict(self, mode: str, n: int, steps: int, draft_tokens: int) -> float:
        return self.prices(mode)(n, steps, draft_tokens)

    def prices(self, mode: str) -> Callable[[int, int, int], float]:
        """``predict`` for one mode, its coefficients looked up once (a plan prices
        every cap of its call with it)."""
        if mode not in self.coefficients:
            return lambda n, steps, draft_tokens: 0.0
        table, overhead = self._table, self.overhead

        def price(n: int, steps: int, draft_tokens: int) -> float:
            if n <= 0:
                return 0.0
            return table(mode, n, steps, draft_tokens) + overhead.get((mode, load_bucket(n)), 0.0)
        return price

    def observe(self, mode: str, n: int, steps: int, draft_tokens: int, seconds: float) -> None:
        if mode not in self.coefficients or n <= 0:
            return
        key = (mode, load_bucket(n))
        table = self._table(mode, n, steps, draft_tokens)
        seconds = min(seconds, OUTLIER * max(table + self.overhead.get(key, 0.0), OVERHEAD_FLOOR))
        residual = seconds - table
        # From the table up, never from the first call: calls are only observed while a
        # mode drafts, so an overestimate stops the calls that would correct it, and one
        # slow first call (a new shape's allocation planning, a busy moment) would stop
        # drafting for whole requests. An underestimate keeps the mode drafting, and so is
        # learnt away.
        self.overhead[key] = (1 - self.smoothing) * self.overhead.get(key, 0.0) + self.smoothing * residual

    def catch_up_token(self, mode: str, prior_steps: float) -> float:
        """Seconds a draft model spends per token it catches up on (a prompt at first
        contact, the tokens of rounds it sat out): learnt from the calls that carried
        catch-ups, ``prior_steps`` of its step until such calls have been seen."""
        seen = self.catch_ups.get(mode)
        if seen is None or seen[1] < MIN_CATCH_UP_CALLS:
            return prior_steps * self.marginal_step(mode)
        (tokens, seconds), _ = seen
        return max(0.0, seconds / tokens)

    def observe_catch_up(self, mode: str, n: int, steps: int, draft_tokens: int, catch_up_tokens: int,
                         seconds: float) -> None:
        """A call drafting as ``observe`` says also fed ``catch_up_tokens`` the draft model
        had missed: what it cost beyond the call's own prediction is their price. Learnt as
        a ratio of running sums, so that a whole prompt weighs more than a lag of a few
        tokens, whose residual is mostly noise. (The fixed prior underprices a large batch's
        first contacts: docs/adaptive-speculation.md.)"""
        if mode not in self.coefficients or n <= 0 or catch_up_tokens <= 0:
            return
        residual = max(0.0, seconds - self.predict(mode, n, steps, draft_tokens))
        _learn(self.catch_ups, mode, (float(catch_up_tokens), residual), self.smoothing)
