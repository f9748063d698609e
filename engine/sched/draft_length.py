"""Adaptive speculation: how many drafts each sequence gets this round.

A draft costs target compute whether or not it is accepted. At batch 1 a verify pass
is memory-bound, so drafts are nearly free and k = k_max pays; at a large batch on a
CPU the pass is compute-bound, every draft row costs about what a whole sequence's
step costs, and a weak proposer loses to plain decoding. So each round the scheduler
asks ``DraftLengthController.plan`` for every sequence's k in 0..k_max and minimises
the mean expected time per token over the batch's requests, T(plan) * mean_s 1 / E_s:

    E_s(k)  = 1 + sum_{i<=k} prod_{j<=i} alpha_s,j      (tokens sequence s commits)
    T(plan) = T_verify(batch, rows) + sum_mode T_draft(mode, steps)

Every sequence in a call waits for the whole call, so drafting rows for some make the
others slower; the mean time per token is what each request sees. The batch's tokens
per second would reward a plan that speeds up the sequences that found drafts at the
others' expense (``docs/adaptive-speculation.md`` compares the two objectives).

``alpha_s,j`` is the sequence's live acceptance of draft position j given the drafts
before it were accepted, shrunk toward its mode's average while the sequence has few
rounds. ``T_verify`` and ``T_draft`` are the target's and each proposer's costs,
measured when their workers start (``sched.costs``) and corrected online by what
real calls cost beyond them, per batch-size bucket. k = 0 is a plain target round.
Rounds stay lossless whatever k is: only how many drafts are verified changes, never how.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import product
from typing import Sequence

from engine.sched.costs import DraftCostModel, VerifyCostModel

PRIOR_ACCEPTANCE = 0.7   # a mode's acceptance before it has any rounds: optimistic, so it gets tried
MODE_PRIOR_WEIGHT = 4.0  # rounds' worth of weight that prior keeps in a mode's average: one early
                         # rejection must not sink a position the mode then never drafts again
PRIOR_WEIGHT = 8.0       # rounds' worth of weight the mode average keeps in a sequence's estimate
MODE_DECAY = 0.995       # per recorded round: a mode's average follows the current traffic
MIXED_PLAN_MARGIN = 0.05  # a plan between "no drafts" and "every maximum" must be predicted this much
                          # faster than the better of the two: below the cost model's error, a pinned
                          # k's plan is as good a guess (docs/adaptive-speculation.md)
# Exploration: after EXPLORE_EVERY plans in a row in which a mode drafted short of its
# maximum, in a call of EXPLORE_BATCH sequences, one sequence drafts one position deeper;
# in proportion to the call's sequences otherwise (``explore_wait``), but after at least
# EXPLORE_MIN. In a large call one exploring sequence costs the whole batch (a split
# verify, a layout shuffled, a draft model's catch-up) and tells no more than in a small
# one. Alone it costs a head step and a row the pass has room for, and a request lasts a
# few dozen rounds: a wait of EXPLORE_EVERY would let one unlucky start (position 2
# rejected a few times) keep a one-stream request at one draft to its end.
EXPLORE_EVERY, EXPLORE_BATCH, EXPLORE_MIN = 32, 4, 8
SEVERAL_ROUNDS_MARGIN = 0.1  # several plain rounds in one call must be predicted this much faster than a
                             # drafting plan: they skip that many chances to re-plan, and near the
                             # break-even a plan would otherwise swing to them on noise
SEVERAL_PRIOR_MARGIN = 0.25  # ... and this much while they are priced from the prior (``VerifyCostModel.
                             # plain_rounds``), which underprices them at a large batch: real pasts are
                             # longer than the calibration's (docs/adaptive-speculation.md)
ENGAGE_MARGIN = 0.1      # see ``DraftLengthController._best``
HELD_CALLS = 16          # calls whose plans are held at once (a lane and replica each); more: start over
HOLD_GROWTH = 4          # a plan re-planned to itself holds twice as long each time, up to this many times
                         # ``replan_rounds`` (``DraftLengthController.plan``)
CATCH_UP_STEPS = 0.15    # a draft model's step-equivalents per token of catch-up until calls that carried
                         # catch-ups have priced it (``DraftCostModel.catch_up_token``): it feeds them in one
                         # batched pass, so a token costs a fraction of a step (docs/adaptive-speculation.md)


def explore_wait(sequences: int) -> float:
    """Plans in a row short of a mode's maximum before one sequence of a call of
    ``sequences`` explores one position deeper."""
    return max(EXPLORE_MIN, EXPLORE_EVERY * sequences / EXPLORE_BATCH)


@dataclass
class _Counts:
    tested: list[float] = field(default_factory=list)   # rounds that reached position i (drafts < i all accepted)
    passed: list[float] = field(default_factory=list)   # ... and accepted it

    def record(self, drafts: int, accepted: int, decay: float = 1.0) -> None:
        if decay != 1.0:
            self.tested = [t * decay for t in self.tested]
            self.passed = [p * decay for p in self.passed]
        grow = drafts - len(self.tested)
        if grow > 0:
            self.tested.extend([0.0] * grow)
            self.passed.extend([0.0] * grow)
        for i in range(min(drafts, accepted + 1)):  # positions the target actually judged
            self.tested[i] += 1
            self.passed[i] += i < accepted


class AcceptanceTracker:
    """Per-sequence and per-mode acceptance of each draft position, conditional on the
    drafts before it being accepted (the only way a position is ever judged)."""

    def __init__(self) -> None:
        self._modes: dict[str, _Counts] = {}
        self._seqs: dict[object, _Counts] = {}

    def record(self, seq_id, mode: str, drafts: int, accepted: int) -> None:
        if drafts <= 0:
            return
        self._modes.setdefault(mode, _Counts()).record(drafts, accepted, MODE_DECAY)
        self._seqs.setdefault(seq_id, _Counts()).record(drafts, accepted)

    def forget(self, seq_id) -> None:
        self._seqs.pop(seq_id, None)

    def alphas(self, seq_id, mode: str, k_max: int) -> list[float]:
        """Each position's estimate: the sequence's own counts, shrunk toward its mode's
        average (itself shrunk toward ``PRIOR_ACCEPTANCE``), each ``(passed + weight *
        prior) / (tested + weight)``."""
        mode_counts, own = self._modes.get(mode, _NO_COUNTS), self._seqs.get(seq_id, _NO_COUNTS)
        mode_tested, mode_passed, tested, passed = mode_counts.tested, mode_counts.passed, own.tested, own.passed
        known_mode, known = len(mode_tested), len(tested)
        rates = []
        for i in range(k_max):
            prior = (((mode_passed[i] if i < known_mode else 0.0) + MODE_PRIOR_WEIGHT * PRIOR_ACCEPTANCE)
                     / ((mode_tested[i] if i < known_mode else 0.0) + MODE_PRIOR_WEIGHT))
            rates.append(((passed[i] if i < known else 0.0) + PRIOR_WEIGHT * prior)
                         / ((tested[i] if i < known else 0.0) + PRIOR_WEIGHT))
        return rates


_NO_COUNTS = _Counts()  # read only: what a sequence or mode without rounds has


@dataclass(frozen=True)
class DraftRequest:
    """One sequence's entry in a round's plan."""

    seq_id: object
    mode: str
    k_max: int          # the most this round may draft (request's k, capped by length/context)
    adaptive: bool      # False: the request pinned k = k_max
    catch_up: float = 0.0  # tokens a draft model must feed before it drafts, beyond a round's,
                           # per round the request has left (``SequenceDriver.catch_up``)
    ending: bool = False   # the request's budget has one token left: k_max is 0 for its sake, not
                           # for want of drafts, and several plain rounds cost it nothing
    cold: bool = False     # its proposer has not seen the sequence yet (``SequenceDriver.proposer_cold``)


@dataclass
class _HeldPlan:
    """A call's plan while it holds: for the maxima it was made for, ``hold`` rounds."""

    ks: list[int]
    steps: int
    maxima: list[int]
    hold: int
    rounds: int  # rounds it has served so far

    def serves(self, maxima: list[int]) -> list[int] | None:
        """This round's drafts if the plan still holds for these maxima: its own for the
        same maxima; the new maxima where it drafts every maximum and they only shrank."""
        if self.rounds >= self.hold:
            return None
        if maxima == self.maxima:
            return self.ks
        if self.ks == self.maxima and all(m <= h for m, h in zip(maxima, self.maxima)):
            return maxima
        return None


class DraftLengthController:
    def __init__(self, verify_costs: VerifyCostModel, draft_costs: DraftCostModel,
                 acceptance: AcceptanceTracker | None = None, plain_steps: int = 1, replan_rounds: int = 1) -> None:
        self.verify_costs, self.draft_costs = verify_costs, draft_costs
        self.acceptance = acceptance or AcceptanceTracker()
        self.plain_steps = plain_steps  # plain rounds a target call may run back to back
        self.last_steps = 1             # ... and how many the last plan chose (1 unless it drafts nothing)
        self.replan_rounds = replan_rounds  # rounds a plan holds while its call stays the same
        self.plans = 0                  # plans computed (not held), for tests
        self._held: dict[tuple, _HeldPlan] = {}  # call (its sequences) -> its plan
        self._idle_plans: dict[str, int] = {}
        self._follow_ups: dict[str, object] = {}  # mode -> the sequence it explored with last plan

    def plan(self, requests: Sequence[DraftRequest]) -> list[int]:
        """Drafts for each request of one target call, in order (``_best``), exploring
        now and then (``_explore``).

        Planning is a tax where adaptive does what a pinned k does (one stream, a good
        head): a computed plan is a measurable share of a one-stream round, the process's
        caches being cold after each onnxruntime run (docs/adaptive-speculation.md), so a
        plan is computed only when it can matter:

        - *Nothing to decide*: every sequence adaptive, none with drafts to verify (a
          prompt lookup that found nothing) and none on its last token -- a plain round,
          no plan (most of prompt lookup's rounds at one stream).
        - *Held*: a call whose sequences and maxima are the same as a recent call's keeps
          that call's plan for ``replan_rounds`` rounds; each time a re-plan comes out the
          same, the next one waits twice as long, up to ``HOLD_GROWTH`` times that (what a
          plan weighs, live acceptance and measured costs, moves little from one round to
          the next; a sequence that joins or leaves plans afresh at once).
        - *Shrunk*: a held plan that drafts every maximum carries over when maxima only
          shrink (a request nearing its end, a prompt lookup finding fewer): every new
          maximum is what a pinned k would do, and a smaller round cannot make drafting
          the maximum worse by the plan's own measure.

        A call of several plain rounds counts as that many rounds; exploring happens round
        by round whatever the plan's source."""
        if all(r.adaptive and r.k_max == 0 and not r.ending for r in requests):
            self.last_steps = 1  # the plan _best would make: nothing to verify, a plain round
            return [0] * len(requests)
        key = tuple((r.seq_id, r.mode, r.adaptive) for r in requests) if self.replan_rounds > 1 else None
        maxima = [r.k_max for r in requests]
        held = self._held.get(key)
        reused = held.serves(maxima) if held is not None else None
        if reused is not None:
            best_ks, best_steps = reused, held.steps
            held.rounds += best_steps
        else:
            best_ks, best_steps = self._best(requests)
            self.plans += 1
            if key is not None:
                hold = self.replan_rounds
                if held is not None and held.rounds >= held.hold and (held.maxima, held.ks, held.steps) == (
                        maxima, best_ks, best_steps):  # the same call re-planned to the same plan
                    hold = min(2 * held.hold, HOLD_GROWTH * self.replan_rounds)
                if len(self._held) >= HELD_CALLS and key not in self._held:
                    self._held.clear()
                self._held[key] = _HeldPlan(list(best_ks), best_steps, maxima, hold, best_steps)
        best_ks = list(best_ks)
        self._explore(requests, best_ks, best_steps)
        self.last_steps = best_steps if not any(best_ks) else 1  # exploring may have added a draft
        return best_ks

    def _best(self, requests: Sequence[DraftRequest]) -> tuple[list[int], int]:
        """The plan for one target call (``_best_of``), engaging a draft model for
        sequences it has never seen only when that is predicted ``ENGAGE_MARGIN`` faster
        than the best plan without them: a draft model that drafts for a sequence first
        prefills it and then keeps up with it for the rest of the request, and that costs
        more than its rounds' prices say (docs/adaptive-speculation.md measures by how much)."""
        ks, steps, rate = self._best_of(requests)
        new = [r.cold and r.mode not in self.draft_costs.restarting for r in requests]
        if any(k and cold for k, cold in zip(ks, new)):
            left_out = [replace(r, k_max=0, adaptive=False) if cold else r for r, cold in zip(requests, new)]
            alt_ks, alt_steps, alt_rate = self._best_of(left_out)
            if rate < alt_rate * (1 + ENGAGE_MARGIN):
                return alt_ks, alt_steps
        return ks, steps

    def _best_of(self, requests: Sequence[DraftRequest]) -> tuple[list[int], int, float]:
        """The plan for one target call: each request's drafts, how many plain rounds
        the call runs (1 unless it drafts nothing), and its worth (tokens/s).

        Every mode gets a cap K (tried exhaustively for up to two adaptive modes in the
        call, coordinate-wise beyond); under a cap, each sequence drafts while its next
        draft's expected tokens pay for the draft-model step it costs at the
        batch's rate. The caps whose plan has the least mean time per token win -- but a
        plan between the two a user could pin (no drafts, every maximum) only when it is
        predicted ``MIXED_PLAN_MARGIN`` faster than the better of them: where the model
        cannot tell plans apart, doing what a pinned k does costs nothing. The target call
        is costed padded: a batched verify runs every sequence to the longest one's rows.

        A plan without drafts may run ``plain_steps`` rounds in its one target call
        (the second value says whether it does): one hop and one round's bookkeeping for that
        many tokens a sequence, where a drafting round pays its hops for its expected
        tokens. Through a server whose hops cost milliseconds that can beat drafting at one
        stream; in-process it rarely does."""
        call = _CallPricing(self, requests)
        modes = sorted({r.mode for r in requests if r.adaptive and r.k_max > 0})
        top = {m: max(r.k_max for r in requests if r.mode == m and r.adaptive) for m in modes}
        best_rate, best_ks, best_steps = -1.0, [r.k_max if not r.adaptive else 0 for r in requests], 1
        if len(modes) <= 2:
            choices = product(*(range(top[m] + 1) for m in modes))
        else:  # coordinate-wise: each mode's cap in turn, the others at their maximum
            choices = [tuple(top[x] if x != m else k for x in modes) for m in modes for k in range(top[m] + 1)]
        baselines = []  # (rate, ks, steps) of the plans a user could pin: no drafts, every maximum
        # Several plain rounds skip as many chances to draft: only where this round's plan
        # weighed drafts for every adaptive sequence, so that the plan, not the absence of
        # drafts, says no (a prompt lookup that found nothing this round may find some the next).
        # A request on its last token counts as weighed: it ends this round whatever the plan,
        # and blocking on it would run a wave's tail one plain round a call, dearer a token
        # than target-only's tail.
        several_ok = self.plain_steps > 1 and all(r.k_max > 0 or r.ending for r in requests if r.adaptive)
        several = None  # the batch's tokens/s over ``plain_steps`` plain rounds in one call, once asked
        for caps in choices:
            ks, rate = call.under_caps(dict(zip(modes, caps)))
            steps = 1
            if several_ok and not any(ks):
                if several is None:
                    n = len(requests)
                    margin = SEVERAL_ROUNDS_MARGIN if self.verify_costs.several_known(n) else SEVERAL_PRIOR_MARGIN
                    several = n * self.plain_steps / self.verify_costs.plain_rounds(n, self.plain_steps)
                # At a tie (nothing of the call learnt yet: both priced from the table) run them
                # several to a call, as target-only does: the call's fixed cost is then paid
                # once for several tokens.
                if several >= rate * (1 - 1e-9):  # weighed against drafting plans with a margin below
                    rate, steps = max(rate, several / (1 + margin)), self.plain_steps
            if all(c == 0 for c in caps) or all(c == top[m] for c, m in zip(caps, modes)):
                baselines.append((rate, ks, steps))
            if rate > best_rate * (1 + 1e-6):
                best_rate, best_ks, best_steps = rate, ks, steps
        baseline_rate, baseline_ks, baseline_steps = max(baselines, key=lambda b: b[0],
                                                         default=(0.0, best_ks, best_steps))
        if best_rate < baseline_rate * (1 + MIXED_PLAN_MARGIN):
            best_ks, best_steps, best_rate = baseline_ks, baseline_steps, baseline_rate
        return best_ks, best_steps, best_rate

    def _catch_up_s(self, r: DraftRequest) -> float:
        """Seconds a draft model's catch-up adds to this round if the sequence drafts (a
        head restarts every pass: it has none)."""
        if not r.catch_up or r.mode in self.draft_costs.restarting:
            return 0.0
        return r.catch_up * self.draft_costs.catch_up_token(r.mode, CATCH_UP_STEPS)

    def _explore(self, requests: Sequence[DraftRequest], ks: list[int], steps: int = 1) -> None:
        """Acceptance of draft position j is only measured in rounds that draft past it. A
        mode whose plans have stopped short of its maximum for ``explore_wait`` plans in a
        row gets one sequence drafting one position deeper (from 0: one draft), so its
        estimates follow the traffic (and recover from an unlucky start) instead of
        freezing at "not worth it". A draft model explored from 0 drafts one more round
        with the same sequence: the first call is a catch-up, not a measurement. A plan of
        ``steps`` plain rounds in one call counts as that many plans: the wait is in
        rounds (at one stream, with several plain rounds a call, a wait in plans would
        outlast a request)."""
        waiting: dict[str, list[int]] = {}  # mode -> its adaptive sequences that could draft
        for i, r in enumerate(requests):
            if r.adaptive and r.k_max > 0:
                waiting.setdefault(r.mode, []).append(i)
        for mode, members in waiting.items():
            explored = self._follow_ups.pop(mode, None)
            again = next((i for i in members if requests[i].seq_id == explored), None)
            if again is not None and ks[again] == 0 and mode not in self.draft_costs.restarting:
                # The exploring call after plain rounds first catches a draft model up on
                # their tokens, which is never observed as what a draft costs; without a
                # second drafting round its cost, overestimated once (a calibration on a
                # loaded machine), would never be measured again.
                ks[again] = 1
                continue
            short = [i for i in members if ks[i] < requests[i].k_max]
            if len(short) < len(members) and max(ks[i] for i in members) == max(requests[i].k_max for i in members):
                self._idle_plans[mode] = 0  # some sequence drafts the deepest allowed: every position is judged
                continue
            self._idle_plans[mode] = self._idle_plans.get(mode, 0) + 1
            if self._idle_plans[mode] < explore_wait(len(requests)):
                if not any(ks):
                    self._idle_plans[mode] += steps - 1  # the call's further plain rounds
                continue
            self._idle_plans[mode] = 0
            deepest = max(short, key=lambda i: ks[i])
            if ks[deepest] == 0:
                self._follow_ups[mode] = requests[deepest].seq_id
            ks[deepest] += 1


class _CallPricing:
    """One target call's plans priced from tables made once per ``plan``: each sequence's
    expected tokens for every k (prefix products of its alphas), its draft-model step and
    catch-up, and the call's verify and proposer costs as functions bound once: a plan
    weighs every cap of its call, and none of these depends on the cap."""

    def __init__(self, controller: DraftLengthController, requests: Sequence[DraftRequest]) -> None:
        self.requests = requests
        acceptance, draft_costs = controller.acceptance, controller.draft_costs
        self.reach: list[list[float]] = []   # per request: P(drafts 1..j+1 all accepted), j < k_max
        self.inverse: list[list[float]] = []  # per request: 1 / expected tokens committed with k drafts
        for r in requests:
            reach, tokens, reaches, inverse = 1.0, 1.0, [], [1.0]
            for alpha in acceptance.alphas(r.seq_id, r.mode, r.k_max):
                reach *= alpha
                tokens += reach
                reaches.append(reach)
                inverse.append(1.0 / tokens)
            self.reach.append(reaches)
            self.inverse.append(inverse)
        self.catch_up = [controller._catch_up_s(r) for r in requests]
        # A draft model's step, where pruning applies (adaptive, not a head, a measured step)
        self.step = [draft_costs.marginal_step(r.mode) if r.adaptive and r.mode not in draft_costs.restarting else 0.0
                     for r in requests]
        self.verify = controller.verify_costs.round_prices(len(requests))  # rows -> seconds
        self.modes = list(dict.fromkeys(r.mode for r in requests))
        self.mode_of = [self.modes.index(r.mode) for r in requests]
        self.draft = [draft_costs.prices(mode) for mode in self.modes]  # (n, steps, tokens) -> seconds

    def under_caps(self, caps: dict[str, int]) -> tuple[list[int], float]:
        """Each sequence's k under its mode's cap, and the plan's worth."""
        ks = [min(r.k_max, caps.get(r.mode, r.k_max)) if r.adaptive else r.k_max for r in self.requests]
        rate = self.rate(ks)
        # A batched verify pads every sequence to the call's longest, so below the longest a
        # draft costs no target row; what it can still cost is a draft model's step. Drop
        # the trailing drafts whose expected tokens do not pay for that at the batch's rate.
        # A draft model that sat out rounds (or never saw the sequence) first feeds what it
        # missed: its first draft also pays for that catch-up (spread over the rounds left).
        pruned = False
        for i, step in enumerate(self.step):
            if step == 0.0:
                continue
            keep, reaches = 0, self.reach[i]
            for j in range(ks[i]):
                if reaches[j] < rate * (step + (self.catch_up[i] if j == 0 else 0.0)):
                    break
                keep = j + 1
            if keep < ks[i]:
                ks[i], pruned = keep, True
        return ks, self.rate(ks) if pruned else rate

    def rate(self, ks: list[int]) -> float:
        """A plan's worth as tokens per second: the batch's size over its mean expected
        time per token (sum_s E_s / T when every sequence commits alike)."""
        inverse, catch_up, widest = 0.0, 0.0, 0  # catch_up: seconds of draft models catching up first
        counts = [0] * len(self.modes)  # per mode: drafting sequences, their longest k, their drafts
        longest, drafts = counts[:], counts[:]
        for i, k in enumerate(ks):
            inverse += self.inverse[i][k]
            if k > 0:
                m = self.mode_of[i]
                counts[m] += 1
                drafts[m] += k
                if k > longest[m]:
                    longest[m] = k
                catch_up += self.catch_up[i]
                if k > widest:
                    widest = k
        n = len(ks)
        seconds = self.verify(n * (widest + 1)) + catch_up  # padded to the longest
        for m, count in enumerate(counts):
            if count:
                seconds += self.draft[m](count, longest[m], drafts[m])
        expected = n ** 2 / inverse if inverse else 0.0
        return expected / seconds if seconds > 0 else float("inf")
