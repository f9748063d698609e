"""Adaptive speculation: how many drafts each sequence gets this round.

A draft costs target compute whether or not it is accepted. At batch 1 a verify pass
is memory-bound, so drafts are nearly free and drafting the maximum pays; at a large
batch on a CPU the pass is compute-bound, every draft row costs about what a whole
sequence's step costs, and a weak proposer loses to plain decoding. So each round the
scheduler asks ``DraftLengthPlanner.plan`` for every sequence's draft count n in
0..max_num_drafts and minimises the mean expected time per token over the batch's
requests, T(plan) * mean_s 1 / E_s:

    E_s(n)  = 1 + sum_{i<=n} prod_{j<=i} alpha_s,j      (tokens sequence s commits)
    T(plan) = T_verify(batch, rows) + sum_mode T_draft(mode, steps)

Every sequence in a call waits for the whole call, so drafting rows for some make the
others slower; the mean time per token is what each request sees. The batch's tokens
per second would reward a plan that speeds up the sequences that found drafts at the
others' expense (``docs/adaptive-speculation.md`` compares the two objectives).

``alpha_s,j`` is the sequence's live acceptance of draft position j given the drafts
before it were accepted (``sched.acceptance``). ``T_verify`` and ``T_draft`` are the
target's and each proposer's costs, measured when their workers start
(``sched.calibration``) and corrected online by what real calls cost beyond them, per
batch-size bucket (``sched.cost_models``); a plan is priced by ``sched.call_pricing``.
n = 0 is a plain target round. Rounds stay lossless whatever n is: only how many drafts
are verified changes, never how.

A plan without drafts may make its target call *multi-step*: several plain rounds back
to back in one call (``SchedulerConfig.plain_steps``, vLLM's num_scheduler_steps).

The planner sits behind the draft-policy seam (``sched.adaptive_drafts``): it is asked
``plan(call)`` before a round's target call and learns through ``observe(record)`` what
the tick then saw (``sched.draft_policy.TickReport``: a verified round, a proposer or
target call and its seconds, a round's time outside its calls and the gap before its
tick), a retired sequence and a proposer mode's measured costs. Which of them teach what
is decided here.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product
from typing import Iterable, NamedTuple, Sequence, Union

from specserve.engine.sched.acceptance import AcceptanceTracker, LookupTracker
from specserve.engine.sched.call_pricing import CallPricing, DraftRequest, catch_up_seconds
from specserve.engine.sched.cost_models import DraftCostModel, VerifyCostModel
from specserve.engine.sched.cost_tables import DraftCostTable, VerifyCostTable
from specserve.engine.sched.draft_policy import ProposerCall, RoundPlan, RoundTime, SequenceRound, TargetCall

MIXED_PLAN_MARGIN = 0.05  # a plan between "no drafts" and "every maximum" must be predicted this much
                          # faster than the better of the two: below the cost model's error, a pinned
                          # plan is as good a guess (docs/adaptive-speculation.md)
# Exploration: after EXPLORE_EVERY plans in a row in which a mode drafted short of its
# maximum, in a call of EXPLORE_BATCH sequences, one sequence drafts one position deeper;
# in proportion to the call's sequences otherwise (``explore_wait``), but after at least
# EXPLORE_MIN. In a large call one exploring sequence costs the whole batch (a split
# verify, a layout shuffled, a draft model's catch-up) and tells no more than in a small
# one. Alone it costs a head step and a row the pass has room for, and a request lasts a
# few dozen rounds: a wait of EXPLORE_EVERY would let one unlucky start (position 2
# rejected a few times) keep a one-stream request at one draft to its end.
EXPLORE_EVERY, EXPLORE_BATCH, EXPLORE_MIN = 32, 4, 8
# A mode whose plans draft nothing pays for each exploration from 0 (a proposer call, a
# verify pass where a plain step would do, a multi-step call broken up): through the
# server, at one stream, two hops and a verify pass of 2 rows, about a round and a half
# (docs/adaptive-speculation.md). So each exploration from 0 that leaves its mode's plans
# at 0 doubles that mode's wait, up to EXPLORE_BACKOFF times (256 rounds alone); a plan
# that drafts for the mode again starts it over.
EXPLORE_BACKOFF = 32
# A draft model explored from 0 first feeds the tokens it missed, on a request it has not
# seen the whole context: ~200 ms for an agentic request of several hundred tokens, and at
# one stream such explorations cost the adaptive draft model 7-21 % of its requests' time
# (docs/speculative-decoding.md, "The draft model's price when it does not draft"). So
# such an exploration waits, beyond its turn, until the plain rounds since the mode's last
# exploration took 1 / EXPLORE_SHARE times its predicted catch-up: it then costs at most
# that share of them. Two explorations go at their turn, as any exploration does: one
# whose catch-up is within EXPLORE_FREE_ROUNDS plain rounds' time (a short prompt), where
# waiting would save little; and the first since the mode last drafted (its backoff at 1),
# which is how a draft model mispriced by one slow call recovers within a short request
# (gated as well, it stayed at k = 0 for three requests in four of
# test_one_stream_drafts_near_the_maximum_with_every_model_proposer in CI: tau 1.1-1.3
# against 2.8 at fixed k).
EXPLORE_SHARE = 0.03
EXPLORE_FREE_ROUNDS = 4
MULTI_STEP_MARGIN = 0.1  # a multi-step call must be predicted this much faster than a drafting plan:
                         # it skips as many chances to re-plan as it has further rounds, and near the
                         # break-even a plan would otherwise swing to it on noise
MULTI_STEP_PRIOR_MARGIN = 0.25  # ... and this much while it is priced from the prior (``VerifyCostModel.
                                # plain_rounds``), which underprices it at a large batch: real pasts are
                                # longer than the calibration's (docs/adaptive-speculation.md)
ENGAGE_MARGIN = 0.1      # see ``DraftLengthPlanner._best``
LOOKUP_PAUSE_MARGIN = 0.02  # several plain rounds instead of looking up again must be predicted this
                            # much faster: the lookups they skip are priced in, so only noise is guarded
HELD_CALLS = 16          # calls whose plans are held at once (a lane and replica each); more: start over
HOLD_GROWTH = 4          # a plan re-planned to itself holds twice as long each time, up to this many times
                         # ``replan_rounds`` (``DraftLengthPlanner.plan``)


def explore_wait(sequences: int) -> float:
    """Plans in a row short of a mode's maximum before one sequence of a call of
    ``sequences`` explores one position deeper."""
    return max(EXPLORE_MIN, EXPLORE_EVERY * sequences / EXPLORE_BATCH)


# -- what the planner learns from (``DraftLengthPlanner.observe``): a tick's records
# (``sched.draft_policy``), a retired sequence, and a proposer mode's measured costs -----
class SequenceRetired(NamedTuple):
    seq_id: object


class DraftCosts(NamedTuple):
    """A proposer mode's measured cost table (``ProposerWorker.draft_costs``)."""

    mode: str
    table: DraftCostTable


Observation = Union[SequenceRound, SequenceRetired, TargetCall, ProposerCall, RoundTime, DraftCosts]


@dataclass
class _HeldPlan:
    """A call's plan while it holds: for the maxima it was made for, ``hold`` rounds."""

    num_drafts: list[int]
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
            return self.num_drafts
        if self.num_drafts == self.maxima and all(m <= h for m, h in zip(maxima, self.maxima)):
            return maxima
        return None

    def replans_to(self, plan: "_HeldPlan") -> bool:
        """Whether ``plan``, made when this one's hold ran out, is this one again."""
        return self.rounds >= self.hold and (self.maxima, self.num_drafts, self.steps) == (
            plan.maxima, plan.num_drafts, plan.steps)


class _Candidate(NamedTuple):
    num_drafts: list[int]
    steps: int    # plain rounds in the call: more than 1 only without drafts
    rate: float   # the plan's worth in tokens per second (``CallPricing.rate``)


class DraftLengthPlanner:
    """Plans each target call's drafts (``plan``) and learns from what the coordinator
    saw (``observe``): live acceptance, and what calls and rounds really cost."""

    def __init__(self, verify_costs: VerifyCostModel, draft_costs: DraftCostModel,
                 acceptance: AcceptanceTracker | None = None, plain_steps: int = 1, replan_rounds: int = 1) -> None:
        self.verify_costs, self.draft_costs = verify_costs, draft_costs
        self.acceptance = acceptance or AcceptanceTracker()
        self.lookups = LookupTracker()
        self.plain_steps = plain_steps  # plain rounds a target call may run back to back
        self.replan_rounds = replan_rounds  # rounds a plan holds while its call stays the same
        self.plans = 0                  # plans computed (not held), for tests
        self._held: dict[tuple, _HeldPlan] = {}  # call (its sequences) -> its plan
        self._idle_plans: dict[str, int] = {}
        self._idle_seconds: dict[str, float] = {}  # mode -> predicted seconds of those plans' calls
        self._backoff: dict[str, int] = {}  # mode -> its wait's multiple (``EXPLORE_BACKOFF``)
        self._follow_ups: dict[str, object] = {}  # mode -> the sequence it explored with last plan

    @classmethod
    def for_target(cls, table: VerifyCostTable, heads: Iterable[str], plain_steps: int = 1,
                   replan_rounds: int = 1) -> "DraftLengthPlanner":
        """A planner for a target whose verify passes ``table`` measured; ``heads``: the
        modes whose proposer is a head (``DraftCostModel``). Each proposer mode's costs
        come in later, as ``DraftCosts`` records."""
        return cls(VerifyCostModel(table), DraftCostModel(heads), plain_steps=plain_steps, replan_rounds=replan_rounds)

    def plan(self, call: Sequence[DraftRequest]) -> RoundPlan:
        """Drafts for each request of one target call, in order (``_best``), exploring
        now and then (``_explore``).

        Planning is a tax where adaptive does what a pinned draft count does (one stream,
        a good head): a computed plan is a measurable share of a one-stream round, the
        process's caches being cold after each onnxruntime run (docs/adaptive-speculation.md),
        so a plan is computed only when it can matter:

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
          maximum is what a pinned count would do, and a smaller round cannot make drafting
          the maximum worse by the plan's own measure.

        A multi-step call counts as that many rounds; exploring happens round by round
        whatever the plan's source.

        *Anchors on demand.* A head drafts from the anchor of its sequence's last target
        call (hidden states; for ``shared_kv`` also slices of the KV cache), which on the
        server travels through the object store: a cost per call that a round without
        drafts pays for nothing. So the plan asks a call for a request's anchor only where
        its next round may draft: this round drafts for it, or its mode explores at the
        next plan (``_explore``). A request without an anchor (``DraftRequest.primed``
        False) that the plan would draft for runs this round plain, in a call of one
        round, and brings its anchor back: it drafts one round later. A request whose
        proposer needs no anchor (a draft model, prompt lookup) is always primed."""
        for r in call:
            if r.adaptive and r.looked_up:
                self.lookups.record(r.seq_id, r.mode, r.max_num_drafts)
        if all(r.adaptive and r.max_num_drafts == 0 and not r.ending for r in call):
            # the plan _best would make: nothing to verify, a plain round -- or several (``_lookup_pause``)
            return RoundPlan([0] * len(call), self._lookup_pause(call), [False] * len(call))
        num_drafts, steps = self._held_or_planned(call)
        explores_next = self._explore(call, num_drafts, steps)
        priming = [n > 0 and not r.primed for n, r in zip(num_drafts, call)]
        num_drafts = [0 if p else n for n, p in zip(num_drafts, priming)]
        anchors = [n > 0 or p or not r.adaptive or r.mode in explores_next
                   for n, p, r in zip(num_drafts, priming, call)]
        # exploring may have added a draft; a priming request drafts next round
        return RoundPlan(num_drafts, 1 if any(num_drafts) or any(priming) else steps, anchors)

    def observe(self, record: Observation) -> None:
        """Learn from what the coordinator saw (the records above)."""
        match record:
            case SequenceRound():
                self.acceptance.record(record.seq_id, record.mode, record.num_drafts, record.accepted,
                                       record.draft_class)
            case SequenceRetired():
                self.acceptance.forget(record.seq_id)
                self.lookups.forget(record.seq_id)
            case TargetCall():
                self._learn_target_call(record)
            case ProposerCall():
                self._learn_proposer_call(record)
            case RoundTime():
                if record.sequences and not record.prefills and not record.multi_step:  # one round's, not several's
                    self.verify_costs.observe_overhead(record.sequences, record.seconds)
                if record.sequences and not record.prefills and record.gap is not None:
                    self.verify_costs.observe_gap(record.sequences, record.gap)
            case DraftCosts():
                self.draft_costs.add(record.mode, record.table)

    def _lookup_pause(self, call: Sequence[DraftRequest]) -> int:
        """Plain rounds for a call in which a lookup (prompt lookup, in the coordinator)
        found no drafts for any sequence: one, so the next round may look again, or
        ``plain_steps`` in one target call, which pays the call's fixed part (on the server,
        the hop) once for that many rounds but skips their lookups. A round that looks
        again is worth its tokens plus what its lookups are expected to add (each
        sequence's odds of finding drafts, ``LookupTracker``, times what they would be
        accepted for, ``AcceptanceTracker``), at the price of a call padded to those
        drafts where any is found; several rounds in one call win when their rate is
        ``LOOKUP_PAUSE_MARGIN`` higher. A sequence not looked up for (``looked_up`` 0) is
        taken to find drafts next round, as before any lookup was seen."""
        steps, n = self.plain_steps, len(call)
        if steps <= 1 or any(not r.looked_up for r in call):
            return 1
        tokens, none_found, widest = 0.0, 1.0, 0
        for r in call:
            find, drafts = self.lookups.odds(r.seq_id, r.mode)
            width = max(1, min(r.looked_up, round(drafts)))
            accepted, expected = 1.0, 0.0
            for alpha in self.acceptance.alphas(r.seq_id, r.mode, width):
                accepted *= alpha
                expected += accepted
            tokens += 1 + find * expected
            none_found *= 1 - find
            widest = max(widest, width)
        costs = self.verify_costs
        looking = (none_found * costs.predict(n, n) + (1 - none_found) * costs.predict(n, n * (widest + 1)))
        paused = n * steps / costs.plain_rounds(n, steps)
        return steps if paused >= (tokens / looking) * (1 + LOOKUP_PAUSE_MARGIN) else 1

    # -- learning ------------------------------------------------------------------------
    def _learn_target_call(self, call: TargetCall) -> None:
        """Calls with a prefill, or with other sequences than the replica's last call's,
        teach the cost model nothing: they pay for arrivals and departures (a joiner's past
        copied into the batch layout, a leaver's row run as a dummy or the layout rebuilt),
        not for the round a plan prices. A multi-step call is learnt as such when all its
        sequences ran alike (none cut short by its budget)."""
        if call.rows and not call.prefills and not call.sequences_changed and len(set(call.steps)) == 1:
            self.verify_costs.observe(call.rows, call.seconds, call.steps[0])

    def _learn_proposer_call(self, call: ProposerCall) -> None:
        """A call that hands a worker a whole context (a sequence's first round, or a
        resync) pays a draft model's prefill, and one after rounds without drafts pays its
        catch-up on their tokens: neither is what a round's drafts cost, so such a call
        prices catch-up tokens instead. (Charged as drafting, a catch-up would keep a draft
        model from drafting, and then no cheaper drafting call would correct it.)"""
        n, longest, total = len(call.num_drafts), max(call.num_drafts), sum(call.num_drafts)
        if call.catch_up_tokens:
            self.draft_costs.observe_catch_up(call.mode, n, longest, total, call.catch_up_tokens, call.seconds)
        else:
            self.draft_costs.observe(call.mode, n, longest, total, call.seconds)

    # -- holding plans -------------------------------------------------------------------
    def _held_or_planned(self, call: Sequence[DraftRequest]) -> tuple[list[int], int]:
        """The call's held plan where it serves this round's maxima, else a new plan,
        which the call then holds. Each is a fresh list: exploring may add a draft."""
        key = tuple((r.seq_id, r.mode, r.adaptive, r.draft_class) for r in call) if self.replan_rounds > 1 else None
        maxima = [r.max_num_drafts for r in call]
        held = self._held.get(key)
        reused = held.serves(maxima) if held is not None else None
        if reused is not None:
            held.rounds += held.steps
            return list(reused), held.steps
        num_drafts, steps = self._best(call)
        self.plans += 1
        if key is not None:
            self._hold(key, held, _HeldPlan(list(num_drafts), steps, maxima, self.replan_rounds, steps))
        return list(num_drafts), steps

    def _hold(self, key: tuple, previous: _HeldPlan | None, plan: _HeldPlan) -> None:
        """Hold a call's new plan: twice as long as its previous one when it re-planned to
        the same (up to ``HOLD_GROWTH`` times ``replan_rounds``)."""
        if previous is not None and previous.replans_to(plan):
            plan.hold = min(2 * previous.hold, HOLD_GROWTH * self.replan_rounds)
        if len(self._held) >= HELD_CALLS and key not in self._held:
            self._held.clear()
        self._held[key] = plan

    # -- the best plan -------------------------------------------------------------------
    def _best(self, call: Sequence[DraftRequest]) -> tuple[list[int], int]:
        """The plan for one target call (``_best_of``), engaging a draft model for
        sequences it has never seen only when that is predicted ``ENGAGE_MARGIN`` faster
        than the best plan without them: a draft model that drafts for a sequence first
        prefills it and then keeps up with it for the rest of the request, and that costs
        more than its rounds' prices say (docs/adaptive-speculation.md measures by how much)."""
        best = self._best_of(call)
        new = [r.cold and r.mode not in self.draft_costs.heads for r in call]
        if any(n and cold for n, cold in zip(best.num_drafts, new)):
            left_out = self._best_of([replace(r, max_num_drafts=0, adaptive=False) if cold else r
                                      for r, cold in zip(call, new)])
            if best.rate < left_out.rate * (1 + ENGAGE_MARGIN):
                return left_out.num_drafts, left_out.steps
        return best.num_drafts, best.steps

    def _best_of(self, call: Sequence[DraftRequest]) -> _Candidate:
        """The plan for one target call: each request's drafts, how many plain rounds
        the call runs (1 unless it drafts nothing), and its worth (tokens/s).

        Every mode gets a cap (``_caps``); under a cap, each sequence drafts while its next
        draft's expected tokens pay for the draft-model step it costs at the batch's rate.
        The caps whose plan has the least mean time per token win -- but a plan between
        the two a user could pin (no drafts, every maximum) only when it is predicted
        ``MIXED_PLAN_MARGIN`` faster than the better of them: where the model cannot tell
        plans apart, doing what a pinned count does costs nothing. The target call is
        costed padded: a batched verify runs every sequence to the longest one's rows.
        A plan without drafts may be a multi-step call (``_MultiStepCall``)."""
        pricing = CallPricing(self.acceptance, self.verify_costs, self.draft_costs, call)
        modes = sorted({r.mode for r in call if r.adaptive and r.max_num_drafts > 0})
        top = {m: max(r.max_num_drafts for r in call if r.mode == m and r.adaptive) for m in modes}
        multi_step = _MultiStepCall(self, call)
        best = _Candidate([r.max_num_drafts if not r.adaptive else 0 for r in call], 1, -1.0)
        pinnable = []  # the plans a user could pin: no drafts, every maximum
        for caps in _caps(modes, top):
            num_drafts, rate = pricing.under_caps(dict(zip(modes, caps)))
            steps = 1
            if multi_step.allowed and not any(num_drafts):
                rate, steps = multi_step.weighed(rate)
            if all(c == 0 for c in caps) or all(c == top[m] for c, m in zip(caps, modes)):
                pinnable.append(_Candidate(num_drafts, steps, rate))
            if rate > best.rate * (1 + 1e-6):
                best = _Candidate(num_drafts, steps, rate)
        baseline = max(pinnable, key=lambda c: c.rate, default=_Candidate(best.num_drafts, best.steps, 0.0))
        return baseline if best.rate < baseline.rate * (1 + MIXED_PLAN_MARGIN) else best

    # -- exploring -----------------------------------------------------------------------
    def _explore(self, call: Sequence[DraftRequest], num_drafts: list[int], steps: int = 1) -> set[str]:
        """Acceptance of draft position j is only measured in rounds that draft past it. A
        mode whose plans have stopped short of its maximum for ``explore_wait`` plans in a
        row gets one sequence drafting one position deeper (from 0: one draft), so its
        estimates follow the traffic (and recover from an unlucky start) instead of
        freezing at "not worth it". A draft model explored from 0 drafts one more round
        with the same sequence: the first call is a catch-up, not a measurement. A
        multi-step call counts as that many plans: the wait is in rounds (at one stream,
        with several plain rounds a call, a wait in plans would outlast a request). Each
        exploration from 0 doubles its mode's wait until a plan drafts for it again
        (``EXPLORE_BACKOFF``), and a draft model's from 0, after one that did not bring
        drafting back, also waits for its catch-up to be paid for (``EXPLORE_SHARE``). A
        sequence that holds its anchor (``primed``) explores before one that does not;
        where none does, the exploration waits for the next plan, whose call brings their
        anchors back. Returns the modes that will explore at the next plan (of a call of
        the same sequences): their calls bring anchors back."""
        waiting: dict[str, list[int]] = {}  # mode -> its adaptive sequences that could draft
        explores_next: set[str] = set()
        for i, r in enumerate(call):
            if r.adaptive and r.max_num_drafts > 0:
                waiting.setdefault(r.mode, []).append(i)
        for mode, members in waiting.items():
            explored = self._follow_ups.pop(mode, None)
            again = next((i for i in members if call[i].seq_id == explored), None)
            if again is not None and num_drafts[again] == 0 and mode not in self.draft_costs.heads:
                # The exploring call after plain rounds first catches a draft model up on
                # their tokens, which is never observed as what a draft costs; without a
                # second drafting round its cost, overestimated once (a calibration on a
                # loaded machine), would never be measured again.
                num_drafts[again] = 1
                continue
            if any(num_drafts[i] for i in members):
                self._backoff[mode] = 1  # the plan drafts for the mode: exploring from 0 has paid
            short = [i for i in members if num_drafts[i] < call[i].max_num_drafts]
            if len(short) < len(members) and (max(num_drafts[i] for i in members)
                                              == max(call[i].max_num_drafts for i in members)):
                self._idle_plans[mode] = 0  # some sequence drafts the deepest allowed: every position is judged
                self._idle_seconds[mode] = 0.0
                continue
            self._idle_plans[mode] = self._idle_plans.get(mode, 0) + 1
            self._idle_seconds[mode] = (self._idle_seconds.get(mode, 0.0)
                                        + steps * self.verify_costs.predict(len(call), len(call)))
            wait = explore_wait(len(call)) * self._backoff.get(mode, 1)
            if self._idle_plans[mode] < wait:
                if not any(num_drafts):
                    self._idle_plans[mode] += steps - 1  # the call's further plain rounds
                if self._idle_plans[mode] + 1 >= wait:
                    explores_next.add(mode)
                continue
            deepest = max(short, key=lambda i: (num_drafts[i], call[i].primed, -call[i].lag))
            if num_drafts[deepest] == 0 and not call[deepest].primed:
                explores_next.add(mode)  # its anchor first: the wait has run out, so next plan explores
                continue
            if num_drafts[deepest] == 0 and self._catch_up_unpaid(mode, call, call[deepest]):
                continue
            self._idle_plans[mode] = 0
            self._idle_seconds[mode] = 0.0
            if num_drafts[deepest] == 0:
                self._follow_ups[mode] = call[deepest].seq_id
                self._backoff[mode] = min(EXPLORE_BACKOFF, 2 * self._backoff.get(mode, 1))
            num_drafts[deepest] += 1
        return explores_next


    def _catch_up_unpaid(self, mode: str, call: Sequence[DraftRequest], r: DraftRequest) -> bool:
        """Whether exploring from 0 with ``r`` must wait for its catch-up (``EXPLORE_SHARE``)."""
        if self._backoff.get(mode, 1) == 1:
            return False  # the mode drafted since its last exploration from 0
        price = catch_up_seconds(self.draft_costs, mode, r.lag)
        free = EXPLORE_FREE_ROUNDS * self.verify_costs.predict(len(call), len(call))
        return price > max(free, EXPLORE_SHARE * self._idle_seconds[mode])


def _caps(modes: list[str], top: dict[str, int]) -> Iterable[tuple[int, ...]]:
    """The caps a plan weighs, one per mode in ``modes`` order: every combination for up
    to two adaptive modes in the call; beyond, coordinate-wise (each mode's cap in turn,
    the others at their maximum)."""
    if len(modes) <= 2:
        return product(*(range(top[m] + 1) for m in modes))
    return [tuple(top[x] if x != m else cap for x in modes) for m in modes for cap in range(top[m] + 1)]


class _MultiStepCall:
    """A plan without drafts as a multi-step call: ``plain_steps`` plain rounds in its one
    target call, one hop and one round's bookkeeping for that many tokens a sequence,
    where a drafting round pays its hops for its expected tokens. Through a server whose
    hops cost milliseconds that can beat drafting at one stream; in-process it rarely does.

    Allowed only where the plan weighed drafts for every adaptive sequence, so that the
    plan, not the absence of drafts, says no (a prompt lookup that found nothing this
    round may find some the next). A request on its last token counts as weighed: it
    ends this round whatever the plan, and blocking on it would run a wave's tail one
    plain round a call, dearer a token than target-only's tail."""

    def __init__(self, planner: DraftLengthPlanner, call: Sequence[DraftRequest]) -> None:
        self.verify_costs, self.steps, self.sequences = planner.verify_costs, planner.plain_steps, len(call)
        self.allowed = self.steps > 1 and all(r.max_num_drafts > 0 or r.ending for r in call if r.adaptive)
        self._priced: tuple[float, float] | None = None

    def _rate_and_margin(self) -> tuple[float, float]:
        """The batch's tokens/s over the call's rounds, and the margin it must win by:
        priced once, when a plan first weighs a cap without drafts."""
        if self._priced is None:
            n, costs = self.sequences, self.verify_costs
            margin = MULTI_STEP_MARGIN if costs.knows_multi_step(n) else MULTI_STEP_PRIOR_MARGIN
            self._priced = n * self.steps / costs.plain_rounds(n, self.steps), margin
        return self._priced

    def weighed(self, rate: float) -> tuple[float, int]:
        """A plan without drafts worth ``rate`` in one round a call: its worth and plain
        rounds as a multi-step call where that is no worse (with a margin, below: it skips
        chances to re-plan), else as it is. Only where ``allowed``."""
        multi_rate, margin = self._rate_and_margin()
        # At a tie (nothing of the call learnt yet: both priced from the table) run them
        # several to a call, as target-only does: the call's fixed cost is then paid
        # once for several tokens.
        if multi_rate >= rate * (1 - 1e-9):
            return max(rate, multi_rate / (1 + margin)), self.steps
        return rate, 1
