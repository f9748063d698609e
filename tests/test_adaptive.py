"""Adaptive speculation: each round's draft count chosen from live acceptance and
measured costs (``engine/sched/draft_length.py``), lossless whatever it chooses.

The controller tests use cost tables shaped like this CPU's measurements (a verify pass
memory-bound at batch 1, compute-bound at 32) so each decision is checked against the
arithmetic, not against a timing; the engine tests run the real models.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from specserve.engine import Engine, GenerationOptions
from specserve.engine.sched.cost_models import MIN_KIND_CALLS, DraftCostModel, VerifyCostModel
from specserve.engine.sched.call_clock import SerialCallClock
from specserve.engine.sched.cost_tables import DraftCostTable, VerifyCostTable
from specserve.engine.sched.verify_split import verify_groups
from specserve.engine.sched.acceptance import AcceptanceTracker
from specserve.engine.sched.call_pricing import CATCH_UP_STEPS, catch_up_seconds
from specserve.engine.sched.draft_length import (ENGAGE_MARGIN, EXPLORE_BACKOFF, EXPLORE_BATCH, EXPLORE_SHARE,
                                                 DraftLengthPlanner, DraftRequest, explore_wait)
from specserve.engine.sched.draft_policy import RoundPlan, RoundTime
from specserve.engine.speculative.proposers.registry import HEAD_MODES

from .conftest import CPU_CONFIG, MODELS, generate_concurrently

# Seconds of one target call by (sequences, rows): ~4 ms at batch 1 whatever the rows;
# at batch 32, 36 ms for one row each and 54 ms for five.
CPU_LIKE = VerifyCostTable({(1, 1): 0.0042, (1, 5): 0.0046, (4, 4): 0.0079, (4, 20): 0.0111, (16, 16): 0.0191,
                            (16, 80): 0.0323, (32, 32): 0.0363, (32, 160): 0.0541})
# As measured here with the batch layout: 9.6 ms for 32 plain rows, 26.5 ms for 32 x 5.
LAYOUT_TABLE = VerifyCostTable({(1, 1): 0.0020, (1, 5): 0.0024, (4, 4): 0.0026, (4, 20): 0.0046, (16, 16): 0.0053,
                                (16, 80): 0.0141, (32, 32): 0.0096, (32, 160): 0.0265})
# One proposer call by (sequences, drafts each): a head runs batched steps, a draft model
# a step per sequence and draft.
HEAD = DraftCostTable({(1, 1): 0.0002, (1, 4): 0.0008, (8, 1): 0.0004, (8, 4): 0.0014})
DRAFT_MODEL = DraftCostTable({(1, 1): 0.0003, (1, 4): 0.0012, (4, 1): 0.0012, (4, 4): 0.0047})


def controller(acceptance: dict[str, float], heads=HEAD, draft=DRAFT_MODEL,
               table: VerifyCostTable = CPU_LIKE) -> DraftLengthPlanner:
    """A controller whose modes have already seen many rounds at the given acceptance."""
    costs = DraftCostModel(HEAD_MODES)
    for mode in ("mtp", "eagle3", "shared_kv"):
        costs.add(mode, heads)
    costs.add("draft_model", draft)
    tracker = AcceptanceTracker()
    rng = np.random.default_rng(0)
    for mode, rate in acceptance.items():
        for n in range(1000):  # rounds of 4 drafts, each accepted with probability ``rate``
            accepted = 0
            while accepted < 4 and rng.random() < rate:
                accepted += 1
            tracker.record(("history", mode, n), mode, 4, accepted)
            tracker.forget(("history", mode, n))
    return DraftLengthPlanner(VerifyCostModel(table), costs, tracker)


def requests(mode: str, n: int, max_num_drafts: int = 4, adaptive: bool = True) -> list[DraftRequest]:
    return [DraftRequest(("seq", mode, i), mode, max_num_drafts, adaptive) for i in range(n)]


def test_one_stream_with_a_good_head_drafts_the_maximum():
    assert controller({"eagle3": 0.75}).plan(requests("eagle3", 1)).num_drafts == [4]


def test_under_load_a_weak_proposer_stops_drafting_and_a_strong_head_keeps_drafting():
    loaded = controller({"prompt_lookup": 0.1, "eagle3": 0.75})
    assert loaded.plan(requests("prompt_lookup", 32)).num_drafts == [0] * 32  # rows cost more than they earn
    assert min(loaded.plan(requests("eagle3", 32)).num_drafts) >= 3           # its drafts still pay for their rows
    # ... and the same weak proposer drafts again once the load is gone
    assert loaded.plan(requests("prompt_lookup", 1)).num_drafts[0] >= 1


def test_speculation_shrinks_as_the_batch_grows():
    plans = {n: controller({"draft_model": 0.5}).plan(requests("draft_model", n)).num_drafts for n in (1, 4, 16, 32)}
    means = [sum(plan) / len(plan) for plan in plans.values()]
    assert means == sorted(means, reverse=True) and means[0] > means[-1]


def test_a_pinned_request_keeps_its_k_and_a_plan_never_exceeds_k_max():
    plan = controller({"prompt_lookup": 0.1}).plan(
        requests("prompt_lookup", 30) + [DraftRequest("pinned", "prompt_lookup", 4, adaptive=False),
                                         DraftRequest("short", "prompt_lookup", 1, adaptive=True)]).num_drafts
    assert plan[-2] == 4 and all(0 <= k <= 4 for k in plan) and plan[-1] <= 1


def test_the_verify_pass_is_costed_padded_to_the_longest_sequence():
    """A batched verify computes every sequence to the longest one's rows. So when 2 of
    32 lookups found drafts, verifying them would pad all 32 to 5 rows: not worth it; when
    24 found drafts, the padding is shared and it is. (Costed by total rows instead, the
    2 sequences' 8 rows would look cheap and be verified.)"""
    loaded = controller({"prompt_lookup": 0.84})
    found = lambda n: [DraftRequest(i, "prompt_lookup", 4 if i < n else 0, True) for i in range(32)]
    assert loaded.plan(found(2)).num_drafts == [0] * 32
    assert loaded.plan(found(24)).num_drafts[:24] == [4] * 24


def test_a_plan_does_not_buy_some_requests_speed_with_the_others_time():
    """Drafting rows make the whole call dearer, so every sequence in it pays, drafting or
    not. When 10 of 16 lookups found drafts, verifying them would commit more tokens per
    second in all (an aggregate objective drafted 20) but slow the 6 others more than it
    speeds up the average request: the plan minimises the mean time per token over the
    batch's requests, and stays plain. When all 16 found drafts, everyone gains."""
    loaded = controller({"prompt_lookup": 0.84}, table=LAYOUT_TABLE)
    found = lambda n: [DraftRequest(i, "prompt_lookup", 4 if i < n else 0, True) for i in range(16)]
    assert loaded.plan(found(10)).num_drafts == [0] * 16
    assert loaded.plan(found(16)).num_drafts == [4] * 16


def test_the_target_runs_a_few_drafting_sequences_apart_when_that_is_much_cheaper():
    """One call pads every sequence to the widest; when one of 32 sequences drafts, the
    target runs it apart in a small second call. Not when the split saves little (24 of
    32 drafting) or when a second call's fixed cost dominates (batch 2)."""
    table = LAYOUT_TABLE
    assert verify_groups([5] + [1] * 31, table) == [list(range(1, 32)), [0]]
    assert verify_groups([5] * 24 + [1] * 8, table) == [list(range(32))]
    assert verify_groups([5, 1], table) == [[0, 1]]
    assert verify_groups([5] * 32, table) == [list(range(32))]
    assert verify_groups([5] + [1] * 31, None) == [list(range(32))]  # no table yet: one call


def test_acceptance_is_conditional_on_reaching_a_position():
    tracker = AcceptanceTracker()
    for _ in range(50):
        tracker.record("s", "m", 4, 0)   # rejected at position 1: positions 2..4 were never judged
        tracker.record("s", "m", 4, 4)   # all accepted
    alphas = tracker.alphas("s", "m", 4)
    assert alphas[0] == pytest.approx((50 + 8 * 0.7) / (100 + 8), rel=0.05)  # shrunk toward the mode average
    assert all(a > 0.9 for a in alphas[1:])  # reached only in the accepted rounds: all passed there


def test_a_mode_that_stopped_drafting_tries_again_now_and_then_less_often_in_a_large_call():
    """In a call of 4 sequences one draft is tried every ``EXPLORE_EVERY`` plans; in a call
    of 32 a fraction as often, since one exploring sequence costs the whole batch there (a
    split verify, a shuffled batch layout) and tells no more than in a small call; alone,
    more often (the draft-model tests below), since a request lasts a few dozen rounds."""
    assert explore_wait(1) < explore_wait(EXPLORE_BATCH) < explore_wait(32)
    for batch in (EXPLORE_BATCH, 32):
        loaded = controller({"prompt_lookup": 0.1})
        wait = int(explore_wait(batch))
        plans = [loaded.plan(requests("prompt_lookup", batch)).num_drafts for _ in range(wait)]
        assert all(sum(plan) == 0 for plan in plans[:-1]), batch
        assert sum(plans[-1]) == 1  # one draft for one sequence refreshes the estimate


def test_exploring_from_no_drafts_backs_off_until_a_plan_drafts_again():
    """Each exploration from 0 costs a proposer call and a verify where a plain step would
    do; one that leaves the mode's plans at 0 doubles its wait, up to ``EXPLORE_BACKOFF``
    times. A plan that drafts for the mode again starts the wait over."""
    loaded = controller({"eagle3": 0.05})
    wait = int(explore_wait(1))
    call = requests("eagle3", 1)
    doublings = [2 ** n for n in range(EXPLORE_BACKOFF.bit_length())]  # 1, 2, 4, ... EXPLORE_BACKOFF
    explored = [i for i in range(wait * (sum(doublings) + EXPLORE_BACKOFF)) if sum(loaded.plan(call).num_drafts)]
    gaps = [b - a for a, b in zip([-1] + explored, explored)]
    assert gaps == [wait * d for d in doublings + [EXPLORE_BACKOFF]], gaps
    for n in range(400):  # the mode turns good: plans draft again, and the wait starts over
        loaded.acceptance.record(("good", n), "eagle3", 4, 4)
    assert min(loaded.plan(call).num_drafts) > 0
    for n in range(1000):
        loaded.acceptance.record(("bad", n), "eagle3", 4, 0)
    plans = [sum(loaded.plan(call).num_drafts) for _ in range(wait)]
    assert plans[:-1] == [0] * (wait - 1) and plans[-1] == 1


def test_a_call_brings_back_an_anchor_only_where_the_next_round_may_draft():
    """A head drafts from its sequence's last anchor, which on the server is a put and a
    reference per call. A plan asks for a request's anchor where it drafts, or where its
    mode explores at the next plan; a request it would draft for but that holds no anchor
    runs plain, one round, and brings it back; an exploration waits for its anchor rather
    than being spent on a plain round."""
    drafting = controller({"eagle3": 0.75}).plan(requests("eagle3", 1))
    assert drafting == RoundPlan([4], 1) and drafting.anchors == [True]
    unprimed = [DraftRequest("s", "eagle3", 4, True, primed=False)]
    priming = controller({"eagle3": 0.75}).plan(unprimed)
    assert priming == RoundPlan([0], 1) and priming.anchors == [True]
    pinned = controller({"eagle3": 0.05}).plan(requests("eagle3", 1, adaptive=False))
    assert pinned == RoundPlan([4], 1) and pinned.anchors == [True]

    wait = int(explore_wait(EXPLORE_BATCH))
    loaded, call = controller({"eagle3": 0.05}), requests("eagle3", EXPLORE_BATCH)
    plans = [loaded.plan(call) for _ in range(wait - 2)]
    assert all(p.num_drafts == [0] * EXPLORE_BATCH and p.anchors == [False] * EXPLORE_BATCH for p in plans)
    before = loaded.plan(call)  # the next plan explores: this call brings the mode's anchors back
    assert before.num_drafts == [0] * EXPLORE_BATCH and before.anchors == [True] * EXPLORE_BATCH
    assert sum(loaded.plan(call).num_drafts) == 1
    # The same exploration with no anchor in hand: deferred to the next plan, not lost.
    loaded, cold = controller({"eagle3": 0.05}), [replace(r, primed=False) for r in call]
    for _ in range(wait - 1):
        loaded.plan(call)
    deferred = loaded.plan(cold)
    assert deferred.num_drafts == [0] * EXPLORE_BATCH and all(deferred.anchors)
    explored = loaded.plan([replace(cold[0], primed=True), *cold[1:]])
    assert explored.num_drafts == [1] + [0] * (EXPLORE_BATCH - 1)  # the one with an anchor explores


def test_a_call_keeps_its_plan_for_a_few_rounds_and_plans_afresh_when_it_changes():
    """Planning every round taxed one-stream rounds 1.5-2 %, so a plan holds for
    ``replan_rounds`` rounds while its call is the same. What it weighed may move
    meanwhile (here: the head's acceptance collapses); the plan follows at the next
    re-plan, or at once when the call changes (a maximum shrinks near a request's end, a
    sequence joins)."""
    held = controller({"eagle3": 0.75})
    held.replan_rounds = 4
    call = requests("eagle3", 2)
    assert held.plan(call).num_drafts == [4, 4] and held.plans == 1
    for seq in range(200):
        held.acceptance.record(("collapsed", seq), "eagle3", 4, 0)
        held.acceptance.record(call[0].seq_id, "eagle3", 4, 0)
        held.acceptance.record(call[1].seq_id, "eagle3", 4, 0)
    assert [held.plan(call).num_drafts for _ in range(3)] == [[4, 4]] * 3 and held.plans == 1  # held
    assert held.plan(call).num_drafts != [4, 4] and held.plans == 2                       # re-planned
    shorter = [DraftRequest(call[0].seq_id, "eagle3", 2, True), call[1]]
    fresh = controller({"eagle3": 0.75})
    fresh.replan_rounds = 4
    # A plan that drafts every maximum carries over to smaller maxima; one that does not
    # (the collapsed head's) plans afresh, as does a call that grows.
    assert fresh.plan(call).num_drafts == [4, 4] and fresh.plan(shorter).num_drafts == [2, 4] and fresh.plans == 1
    assert held.plan(shorter).num_drafts == held.plan(shorter).num_drafts and held.plans == 3
    assert fresh.plan(call + requests("mtp", 1)).num_drafts and fresh.plans == 2
    # A call of several plain rounds counts as that many: it plans again at the next call.
    plain = controller({"prompt_lookup": 0.1}, table=LAYOUT_TABLE)
    plain.plain_steps, plain.replan_rounds = 8, 4
    plain.verify_costs.multi_step_calls[1] = ((0.01, 0.001), 100)  # 8 plain rounds a call: far cheaper here
    lookup = [DraftRequest("s", "prompt_lookup", 4, True)]
    assert plain.plan(lookup) == RoundPlan([0], 8) and plain.plans == 1
    plain.plan(lookup)
    assert plain.plans == 2


def test_a_plan_that_keeps_coming_out_the_same_holds_longer_and_nothing_to_decide_plans_nothing():
    """Where adaptive drafts what a pinned k does (one stream, a good head) every computed
    plan is a tax (~90 us of a ~5 ms round): a re-plan that comes out the same holds twice
    as long, up to ``HOLD_GROWTH`` times ``replan_rounds``, and a change in the plan starts
    the hold over. A call with nothing to verify (prompt lookup found nothing) plans nothing."""
    steady = controller({"eagle3": 0.75})
    steady.replan_rounds = 4
    call = requests("eagle3", 1)
    computed = []
    for _ in range(4 + 8 + 16 + 16 + 16):
        assert steady.plan(call).num_drafts == [4]
        computed.append(steady.plans)
    assert computed.index(2) == 4 and computed.index(3) == 12 and computed.index(4) == 28  # 4, 8, 16 rounds
    assert computed.index(5) == 44 and steady.plans == 5                                   # ... then 16 again
    for _ in range(300):  # the head collapses: the next re-plan differs, and the hold starts over at 4
        steady.acceptance.record(call[0].seq_id, "eagle3", 4, 0)
        steady.acceptance.record(("other", _), "eagle3", 4, 0)
    assert steady.plan(call).num_drafts == [0] and steady.plans == 6  # due after 16 rounds: re-planned, it differs
    for _ in range(3):
        steady.plan(call)
    assert steady.plans == 6
    steady.plan(call)
    assert steady.plans == 7  # ... so the next re-plan came after 4 rounds, not 16
    nothing = [DraftRequest(i, "prompt_lookup", 0, True) for i in range(3)]
    assert steady.plan(nothing) == RoundPlan([0, 0, 0], 1) and steady.plans == 7
    ending = [DraftRequest("e", "prompt_lookup", 0, True, ending=True)]
    steady.plan(ending)
    assert steady.plans == 8  # a request on its last token is weighed (several plain rounds may pay it)


def test_exploring_counts_rounds_whether_or_not_the_plan_is_held():
    """Held plans still explore: the wait before one sequence drafts deeper is in rounds."""
    for replan_rounds in (1, 4):
        loaded = controller({"prompt_lookup": 0.1})
        loaded.replan_rounds = replan_rounds
        wait = int(explore_wait(EXPLORE_BATCH))
        plans = [loaded.plan(requests("prompt_lookup", EXPLORE_BATCH)).num_drafts for _ in range(wait)]
        assert all(sum(plan) == 0 for plan in plans[:-1]) and sum(plans[-1]) == 1, replan_rounds
    assert loaded.plans < wait


def test_a_draft_model_that_sat_out_rounds_pays_for_its_catch_up():
    """A draft model that skipped rounds (or has never seen the sequence) first feeds what
    it missed, in one pass: about a tenth of a step per token, spread over the rounds the
    request has left. A catch-up that large per round outweighs what drafting gains."""
    loaded = controller({"draft_model": 0.7})
    assert loaded.plan([DraftRequest("s", "draft_model", 4, True, catch_up=10)]).num_drafts == [4]
    assert loaded.plan([DraftRequest("s", "draft_model", 4, True, catch_up=200)]).num_drafts == [0]


def test_a_draft_models_catch_up_is_priced_by_the_calls_that_carried_catch_ups():
    """The prior (a tenth of a step or so per token) stands until calls that fed
    catch-ups have been seen; then what they cost beyond the call's own prediction is the
    price, per token, weighted by tokens: first contacts measured dearer than the prior
    says stop a plan the prior would have drafted."""
    loaded = controller({"draft_model": 0.7})
    costs = loaded.draft_costs
    prior = costs.catch_up_token("draft_model", CATCH_UP_STEPS)
    assert prior == pytest.approx(CATCH_UP_STEPS * costs.marginal_step("draft_model"))
    request = [DraftRequest("s", "draft_model", 4, True, catch_up=30)]
    assert loaded.plan(request).num_drafts == [4]
    own = costs.predict("draft_model", 4, 4, 16)
    for _ in range(3):  # four prompts of 85 tokens at first contact, each priced 6x the prior
        costs.observe_catch_up("draft_model", 4, 4, 16, 4 * 85, own + 4 * 85 * 6 * prior)
    assert costs.catch_up_token("draft_model", CATCH_UP_STEPS) == pytest.approx(6 * prior)
    # A lag of 3 tokens whose call ran faster than predicted moves the price by little
    costs.observe_catch_up("draft_model", 4, 4, 16, 3, 0.5 * own)
    assert costs.catch_up_token("draft_model", CATCH_UP_STEPS) == pytest.approx(6 * prior, rel=0.02)
    loaded._held.clear()
    assert loaded.plan(request).num_drafts == [0]


def test_a_draft_model_engages_a_new_sequence_only_with_a_margin():
    """A draft model that drafts for a sequence first prefills it and then keeps up with
    it to the end: costs beyond what its rounds are priced at. So a plan drafts for
    sequences the draft model has not seen only when predicted ``ENGAGE_MARGIN`` faster
    than leaving them out. Here at 16 sequences drafting is predicted ~9 % faster: the
    sequences it already drafts for keep drafting, new ones are not engaged; alone, where
    drafting is predicted far faster, a new one is. A head has no such cost: it ignores
    ``cold``."""
    loaded = controller({"draft_model": 0.5, "eagle3": 0.5})
    _, _, drafting = loaded._best_of(requests("draft_model", 16))
    _, _, plain = loaded._best_of(requests("draft_model", 16, max_num_drafts=0, adaptive=False))
    assert 1.0 < drafting / plain < 1 + ENGAGE_MARGIN
    warm, cold = requests("draft_model", 16), [replace(r, cold=True) for r in requests("draft_model", 16)]
    assert sum(loaded.plan(warm).num_drafts) >= 16 and loaded.plan(cold).num_drafts == [0] * 16
    assert loaded.plan([replace(cold[0], seq_id="alone")]).num_drafts == [3]
    heads = requests("eagle3", 16)
    assert (loaded.plan([replace(r, cold=True) for r in heads]).num_drafts == loaded.plan(heads).num_drafts
            != [0] * 16)


def test_a_draft_model_explored_from_no_drafts_drafts_a_second_round_to_be_measured():
    """Explored from k = 0, a draft model's first call catches it up on the plain rounds'
    tokens, which is not observed as what a draft costs (see the catch-up test below). One
    more drafting round with the same sequence is what measures it: without it, a draft
    cost overestimated once (calibrated on a loaded machine) was never corrected, and
    draft_model stayed at k = 0 at one stream (tau 1.02 against 2.8 at fixed k, seen when
    the suite shared the machine with another job)."""
    alone = int(explore_wait(1))
    dear = DraftCostTable({(1, 1): 0.05, (1, 4): 0.2, (4, 1): 0.2, (4, 4): 0.8})  # 50 ms a step: never pays
    loaded = controller({"draft_model": 0.7}, draft=dear)
    plans = [loaded.plan([DraftRequest("s", "draft_model", 4, True)]).num_drafts for _ in range(alone + 2)]
    assert all(plan == [0] for plan in plans[:alone - 1]), plans
    assert plans[alone - 1] == [1] and plans[alone] == [1]  # catch-up, then a measured round
    assert plans[alone + 1] == [0]
    heads = controller({"eagle3": 0.7}, heads=DraftCostTable({(1, 1): 0.05, (1, 4): 0.2, (8, 1): 0.4, (8, 4): 1.6}))
    plans = [heads.plan([DraftRequest("s", "eagle3", 4, True)]).num_drafts for _ in range(alone + 1)]
    assert plans[alone - 1] == [1] and plans[alone] == [0]  # a head has no catch-up


def test_a_draft_model_explores_a_request_it_has_not_seen_only_once_plain_rounds_pay_its_prefill():
    """Explored from k = 0 on a request it has never seen, a draft model first prefills the
    whole context: at one stream on agentic requests that cost it 7-21 % of their time. So
    once an exploration from 0 has not brought drafting back, the next waits until the
    plain rounds since it took 1 / EXPLORE_SHARE times its predicted catch-up. The first
    since the mode last drafted, or one on a request it has seen (no lag) or whose
    catch-up is short, explores at its turn."""
    alone = int(explore_wait(1))
    dear = DraftCostTable({(1, 1): 0.05, (1, 4): 0.2, (4, 1): 0.2, (4, 4): 0.8})  # 50 ms a step: never pays
    loaded = controller({"draft_model": 0.7}, draft=dear)
    unseen = DraftRequest("s", "draft_model", 4, True, cold=True, lag=600)
    prefill = catch_up_seconds(loaded.draft_costs, "draft_model", 600)
    round_s = loaded.verify_costs.predict(1, 1)
    due = math.ceil(prefill / (EXPLORE_SHARE * round_s))  # plain rounds that pay for it
    assert due > 4 * alone  # beyond the doubled wait of a second exploration from 0
    plans = [loaded.plan([unseen]).num_drafts for _ in range(alone + 1)]
    assert plans[alone - 1:] == [[1], [1]]  # the first at its turn: a catch-up, then a measured round
    plans = [loaded.plan([unseen]).num_drafts for _ in range(due + 1)]
    first = plans.index([1])
    assert due - 1 <= first <= due + 1 and all(plan == [0] for plan in plans[:first])
    for lag in (0, 1):
        seen = controller({"draft_model": 0.7}, draft=dear)
        plans = [seen.plan([replace(unseen, lag=lag)]).num_drafts for _ in range(alone)]
        assert plans[alone - 1] == [1], lag


def test_a_mode_that_stopped_short_of_its_maximum_tries_one_position_deeper_now_and_then():
    """Position j is only judged in rounds that draft past it. A mode whose plans stop at
    one draft must now and then draft a second, or one unlucky early rejection at position
    2 would keep it at one draft for good (it did: tau 1.8 against 3.4 at fixed k)."""
    alone = int(explore_wait(1))
    tracker = AcceptanceTracker()
    tracker.record("s", "draft_model", 2, 1)  # position 1 accepted, position 2 rejected: once
    slow_steps = DraftCostTable({(1, 1): 0.0003, (1, 4): 0.0060, (4, 1): 0.0012, (4, 4): 0.0240})
    costs = DraftCostModel(HEAD_MODES)
    costs.add("draft_model", slow_steps)
    loaded = DraftLengthPlanner(VerifyCostModel(CPU_LIKE), costs, tracker)
    plans = [loaded.plan([DraftRequest("s", "draft_model", 4, True)]).num_drafts for _ in range(alone)]
    assert all(plan == [1] for plan in plans[:-1]), plans
    assert plans[-1] == [2]


def test_real_calls_correct_the_table_per_kind_of_call():
    """Real calls cost a fixed part per call plus a part that scales with the table (real
    pasts are longer than the calibration's). Seen only plain, the table is scaled by what
    plain calls cost: a padded drafting call is priced within a few percent where an offset
    learnt from plain calls underpriced it by 10 % (at 32 streams here: 31 ms priced, 45
    measured, and the plan drafted for whole batches at a loss). Seen both kinds, the
    model draws the line through them and recovers both parts."""
    model = VerifyCostModel(CPU_LIKE)
    truth = lambda batch, rows: 0.004 + 1.5 * CPU_LIKE.predict(batch, rows)  # noqa: E731
    for _ in range(50):
        model.observe([1] * 32, truth(32, 32))
    assert model.call(32, 32) == pytest.approx(truth(32, 32))
    assert model.call(32, 160) == pytest.approx(truth(32, 160), rel=0.03)
    scaled = model.call(32, 160)
    odd = VerifyCostModel(CPU_LIKE)   # a kind seen once in a bucket (a head that always drafts: its
    odd.calls = dict(model.calls)     # plain call is a sequence's first, dear) does not bend the line
    odd.observe([5] * 32, 3 * truth(32, 160))
    assert odd.call(32, 32) == pytest.approx(truth(32, 32)) and odd.call(32, 160) == pytest.approx(scaled)
    for _ in range(MIN_KIND_CALLS):
        model.observe([5] * 32, truth(32, 160))
    for rows in (32, 96, 160):
        assert model.call(32, rows) == pytest.approx(truth(32, rows), rel=0.01)
    assert model.call(1, 5) == CPU_LIKE.predict(1, 5)  # another bucket learnt nothing
    split = VerifyCostModel(LAYOUT_TABLE)  # where the target runs one drafting sequence apart ...
    split.observe([5] + [1] * 31, 1.0)     # ... that call is not the padded call plans price
    assert split.calls == {}
    model.observe_overhead(32, 0.002)  # what a round costs beyond its calls
    assert model.predict(32, 160) == pytest.approx(model.call(32, 160) + 0.002)
    assert model.predict(32, 32) == pytest.approx(model.call(32, 32) + 0.002)
    assert model.predict(1, 1) == CPU_LIKE.predict(1, 1)
    prices = model.round_prices(32)  # what a plan prices its caps with is ``predict``, looked up once
    assert [prices(rows) for rows in (32, 96, 160)] == [model.predict(32, rows) for rows in (32, 96, 160)]


def test_one_hiccup_does_not_price_a_kind_of_call_out():
    """A drafting call at batch 1 ~25 ms slow (the machine busy for a moment), learnt
    whole, once priced such calls at 6 ms against 3.5 ms; drafting stopped, and nothing
    corrected it for the rest of the request. Past the first few calls, one sample counts
    as at most ``OUTLIER`` times what its kind predicts; a lasting change is still learnt."""
    model = VerifyCostModel(CPU_LIKE)
    for _ in range(20):
        model.observe([5], 0.0035)
        model.observe([1], 0.003)
    before = model.call(1, 5)
    model.observe([5], 0.028)
    assert model.call(1, 5) < 1.15 * before
    for _ in range(40):  # the machine really got slower
        model.observe([5], 0.007)
    assert model.call(1, 5) == pytest.approx(0.007, rel=0.05)


def test_one_slow_first_proposer_call_does_not_price_drafting_out():
    """Proposer calls are only observed while a mode drafts, so an overestimate stops the
    calls that would correct it: a first call 4 ms slow (a new shape's allocation
    planning) learnt whole once kept one-stream drafting off for whole requests. It is
    learnt from the table up; an overhead every call pays is still learnt."""
    costs = DraftCostModel(HEAD_MODES)
    costs.add("eagle3", HEAD)
    ordinary = costs.predict("eagle3", 1, 4, 4)
    costs.observe("eagle3", 1, 4, 4, ordinary + 0.004)
    assert costs.predict("eagle3", 1, 4, 4) < ordinary + 0.001
    for _ in range(60):  # a hop every call now pays
        costs.observe("eagle3", 1, 4, 4, ordinary + 0.003)
    assert costs.predict("eagle3", 1, 4, 4) == pytest.approx(ordinary + 0.003, rel=0.02)


@pytest.fixture(scope="module")
def adaptive_engine():
    config = CPU_CONFIG.model_copy(update={"speculative": CPU_CONFIG.speculative.model_copy(
        update={"adaptive": True})})
    with Engine(MODELS, config) as engine:
        yield engine


@pytest.mark.parametrize("mode", ["prompt_lookup", "draft_model", "mtp", "eagle3", "shared_kv"])
def test_adaptive_rounds_give_the_target_only_tokens(mode, adaptive_engine, heldout_prompts):
    """Sixteen concurrent adaptive requests (a batch where the controller has choices to
    make) and one alone: every output is target-only's, and the drafts really varied."""
    jobs = [(prompt, GenerationOptions(max_new_tokens=32, ignore_eos=True, speculative_mode=mode))
            for prompt in heldout_prompts[:16]]
    reference = [adaptive_engine.generate(p, o.model_copy(update={"speculative_mode": "none"})).token_ids
                 for p, o in jobs]
    results = generate_concurrently(adaptive_engine, jobs)
    assert [r.token_ids for r in results] == reference
    solo = adaptive_engine.generate(*jobs[0])
    assert solo.token_ids == reference[0]
    costs = adaptive_engine.coordinator.policy.planner.verify_costs  # the rounds taught the cost model
    assert (costs.calls or costs.multi_step_calls) and costs.overheads and costs.gaps  # ... and the gaps between ticks
    if mode == "draft_model":  # ... and its first contacts (the prompts' prefills) priced its catch-up
        assert adaptive_engine.coordinator.policy.planner.draft_costs.catch_ups["draft_model"][1] >= 1
    assert adaptive_engine.drain() and adaptive_engine.target.cache.used_blocks == 0


def test_a_seeded_sampled_request_keeps_its_k_unless_it_asks_to_adapt(adaptive_engine):
    """A seed promises a reproducible sample; adapting would tie the sampled rounds' random
    draws to measured timings, so such a request is pinned unless it opts in."""
    create = adaptive_engine.factory.create
    assert create("g", [1, 2], GenerationOptions(speculative_mode="eagle3")).adaptive
    assert create("u", [1, 2], GenerationOptions(speculative_mode="eagle3", temperature=0.8)).adaptive
    assert not create("s", [1, 2], GenerationOptions(speculative_mode="eagle3", temperature=0.8, seed=3)).adaptive
    assert create("o", [1, 2], GenerationOptions(speculative_mode="eagle3", temperature=0.8, seed=3,
                                                 adaptive_speculation=True)).adaptive
    assert not create("n", [1, 2], GenerationOptions(speculative_mode="none")).adaptive


def test_one_stream_drafts_near_the_maximum_with_every_model_proposer(adaptive_engine, heldout_prompts):
    """At batch 1 a verify pass barely grows with its rows and every head and the draft
    model step at a fraction of the target's cost: adaptive rounds should draft (almost)
    as a fixed k does. A first round's proposer call, which pays the draft model's
    prefill of the prompt, once taught the cost model that drafting was ~10x dearer and
    left draft_model at k = 0 (tau 1.02 against 2.79 at fixed k)."""
    for mode in ("draft_model", "mtp", "eagle3", "shared_kv"):
        options = GenerationOptions(max_new_tokens=48, ignore_eos=True, speculative_mode=mode)
        fixed, adaptive = [], []
        for prompt in heldout_prompts[:4]:
            adaptive.append(adaptive_engine.generate(prompt, options).speculative.mean_accepted_length)
            fixed.append(adaptive_engine.generate(prompt, options.model_copy(
                update={"adaptive_speculation": False})).speculative.mean_accepted_length)
        assert np.mean(adaptive) >= 0.85 * np.mean(fixed), (mode, adaptive, fixed)


def test_a_catch_up_after_rounds_without_drafts_is_not_charged_as_drafting(adaptive_engine, heldout_prompts,
                                                                          monkeypatch):
    """After rounds at k = 0 a draft model's next call first feeds it every token those
    rounds committed. Charged as the cost of drafting, that once kept draft_model at k = 0
    at one stream for a whole request: no drafts, so no cheaper call ever corrected it."""
    real_plan = DraftLengthPlanner.plan
    plans = []

    def plan(self, requests):  # three real plans, ten plain rounds, then real plans again
        plans.append(1)
        return RoundPlan([0] * len(requests)) if 3 < len(plans) <= 13 else real_plan(self, requests)

    calls, observed = [], []
    real_propose = adaptive_engine.transport.propose

    async def propose(mode, replica, items, releases):
        calls.append([len(item.new_tokens) for item in items if item.since > 0])
        return await real_propose(mode, replica, items, releases)

    real_observe, real_catch_up, caught = DraftCostModel.observe, DraftCostModel.observe_catch_up, []
    monkeypatch.setattr(DraftLengthPlanner, "plan", plan)
    monkeypatch.setattr(adaptive_engine.transport, "propose", propose)
    monkeypatch.setattr(DraftCostModel, "observe",
                        lambda self, *args: observed.append(args) or real_observe(self, *args))
    monkeypatch.setattr(DraftCostModel, "observe_catch_up",
                        lambda self, *args: caught.append(args) or real_catch_up(self, *args))
    options = GenerationOptions(max_new_tokens=32, ignore_eos=True, speculative_mode="draft_model",
                                num_speculative_tokens=4)
    result = adaptive_engine.generate(heldout_prompts[5], options)
    catch_ups = [c for c in calls if c and max(c) > options.num_speculative_tokens + 1]
    rounds = [c for c in calls if c and max(c) <= options.num_speculative_tokens + 1]
    assert catch_ups, calls  # the first drafting call after the plain rounds caught the model up
    assert len(observed) == len(rounds) and rounds, (calls, observed)
    # ... it prices catch-up tokens instead, as the first contact's call does: the whole
    # context then, the prompt and the prefill's token at least (more if the real plans
    # before it drafted nothing)
    prompt_and_first = len(adaptive_engine.factory.encode(heldout_prompts[5])) + 1
    assert len(caught) == len(catch_ups) + 1 and caught[0][4] >= prompt_and_first, (caught, catch_ups)
    assert [c[4] for c in caught[1:]] == [max(c) - options.num_speculative_tokens - 1 for c in catch_ups]
    assert result.token_ids == adaptive_engine.generate(heldout_prompts[5], options.model_copy(
        update={"speculative_mode": "none"})).token_ids


def test_calls_whose_sequences_changed_do_not_teach_the_verify_cost_model(adaptive_engine, heldout_prompts,
                                                                         monkeypatch):
    """A call with a sequence that just joined (its past copied into the batch layout) or
    just left (a dummy row, a rebuilt layout) pays for arrivals and departures, not for
    the round a plan prices: at 32 streams such calls (14 sequences at the cost of 31)
    priced plain rounds at 28-31 sequences 1.5-1.8x the table, against 1.3x for steady
    calls. One request at a time: each request's first verify follows its prefill, so it
    teaches one call fewer than it makes."""
    observed, calls = [], []
    real_observe, real_step = VerifyCostModel.observe, adaptive_engine.transport.target_step
    monkeypatch.setattr(VerifyCostModel, "observe",
                        lambda self, widths, *args: observed.append(widths) or real_observe(self, widths, *args))

    async def target_step(replica, prefills, verifies, releases):
        if verifies:
            calls.append(len(verifies))
        return await real_step(replica, prefills, verifies, releases)

    monkeypatch.setattr(adaptive_engine.transport, "target_step", target_step)
    options = GenerationOptions(max_new_tokens=12, ignore_eos=True, speculative_mode="eagle3")
    results = [adaptive_engine.generate(prompt, options) for prompt in heldout_prompts[:3]]
    assert len(calls) > 2 * len(results)
    assert len(observed) == len(calls) - len(results), (calls, observed)


def test_the_target_runs_drafting_sequences_apart_when_the_table_says_so(adaptive_engine, heldout_prompts,
                                                                        monkeypatch):
    """Pinned prompt lookup at 16 streams: in a round some sequences found drafts and
    others did not, and the measured table says two calls cost less than one padded to
    five rows. Such rounds run as two calls, plain rows then drafting rows, and every
    output is still target-only's."""
    # The table this machine measured at start-up decides; pin one measured here that says
    # so, or a calibration taken during a busy moment (padding looking cheap) would not.
    monkeypatch.setattr(adaptive_engine.transport.target, "_costs", LAYOUT_TABLE)
    decoder = adaptive_engine.transport.target.target
    real_feed, calls = decoder.feed_batch, []
    monkeypatch.setattr(decoder, "feed_batch", lambda requests: calls.append([len(r.tokens) for r in requests])
                        or real_feed(requests))
    prompts = heldout_prompts[:16]
    pinned = GenerationOptions(max_new_tokens=24, ignore_eos=True, speculative_mode="prompt_lookup",
                               adaptive_speculation=False)
    results = generate_concurrently(adaptive_engine, [(p, pinned) for p in prompts])
    split_rounds = [i for i in range(len(calls) - 1)
                    if len(calls[i]) > 1 and set(calls[i]) == {1} and min(calls[i + 1]) > 1]
    assert split_rounds, calls
    monkeypatch.undo()
    for prompt, result in zip(prompts, results):
        alone = adaptive_engine.generate(prompt, pinned.model_copy(update={"speculative_mode": "none"}))
        assert result.token_ids == alone.token_ids


def test_where_calls_cost_a_hop_plain_rounds_run_several_to_a_call_instead_of_drafting():
    """A plan without drafts may run ``plain_steps`` rounds in its one target call: one
    hop and one round's bookkeeping for that many tokens. In-process a good head's
    drafts still win; where every call also pays a hop (3 ms here, as through the
    server), eight plain rounds a call beat drafting -- and one plain round a call does
    not, so with ``plain_steps`` 1 the plan drafts again. A sequence with no drafts to
    weigh (a prompt lookup that found none) gets one round: it may find some the next."""
    in_process = controller({"eagle3": 0.6}, table=LAYOUT_TABLE)
    in_process.plain_steps = 8
    assert in_process.plan(requests("eagle3", 1)) == RoundPlan([4], 1)
    served = controller({"eagle3": 0.6}, table=LAYOUT_TABLE)
    served.plain_steps = 8
    hop = 0.003
    for _ in range(20):
        served.verify_costs.observe([1], LAYOUT_TABLE.predict(1, 1) + hop)
        served.verify_costs.observe([5], LAYOUT_TABLE.predict(1, 5) + hop)
        served.draft_costs.observe("eagle3", 1, 4, 4, HEAD.seconds[(1, 4)] + hop)
    assert served.plan(requests("eagle3", 1)) == RoundPlan([0], 8)
    served.plain_steps = 1
    assert served.plan(requests("eagle3", 1)) == RoundPlan([4], 1)
    # A prompt lookup that found nothing this round may find drafts the next: one round.
    served.plain_steps = 8
    assert served.plan([DraftRequest("s", "prompt_lookup", 0, True)]) == RoundPlan([0], 1)
    # Where nothing tells one plain round a call from several apart (nothing learnt: both
    # priced from the table), a plan without drafts runs several, as target-only does.
    fresh = controller({"prompt_lookup": 0.1})
    fresh.plain_steps = 8
    assert fresh.plan(requests("prompt_lookup", 32)) == RoundPlan([0] * 32, 8)
    # A request on its last token has no room for drafts, not a lack of them: it does not
    # hold the rest of its call to one plain round.
    ending = [DraftRequest("end", "eagle3", 0, True, ending=True), DraftRequest("on", "eagle3", 4, True)]
    for _ in range(20):
        served.verify_costs.observe([1, 1], LAYOUT_TABLE.predict(2, 2) + hop)
        served.verify_costs.observe([5, 5], LAYOUT_TABLE.predict(2, 10) + hop)
    assert served.plan(ending) == RoundPlan([0, 0], 8)
    assert served.plan([DraftRequest("end", "eagle3", 0, True), ending[1]]) == RoundPlan([0, 0], 1)


def test_the_gap_between_ticks_is_priced_once_a_tick_so_it_favours_several_plain_rounds_a_call():
    """What lies between two of a lane's ticks -- on the server, the router streaming the
    tokens out -- is paid once a tick: a drafting round pays it for its few tokens, a
    multi-step call once for all its rounds'. Where a 1 ms hop alone leaves a good head's
    drafts ahead, a 2 ms gap a tick puts eight plain rounds a call ahead; ticks after an
    idle wait or a prefill say nothing of it."""
    def planner(gap: float | None, prefills: int = 0) -> DraftLengthPlanner:
        plans = controller({"eagle3": 0.6}, table=LAYOUT_TABLE)
        plans.plain_steps = 8
        for _ in range(20):
            plans.verify_costs.observe([1], LAYOUT_TABLE.predict(1, 1) + 0.001)
            plans.verify_costs.observe([5], LAYOUT_TABLE.predict(1, 5) + 0.001)
            plans.verify_costs.observe([1], 8 * LAYOUT_TABLE.predict(1, 1) + 0.001, steps=8)
            plans.draft_costs.observe("eagle3", 1, 4, 4, HEAD.seconds[(1, 4)] + 0.001)
            plans.observe(RoundTime(1, prefills, False, 0.0002, gap))
        return plans

    assert planner(None).plan(requests("eagle3", 1)) == RoundPlan([4], 1)
    assert planner(0.0).plan(requests("eagle3", 1)) == RoundPlan([4], 1)
    assert planner(0.002, prefills=1).plan(requests("eagle3", 1)) == RoundPlan([4], 1)
    served = planner(0.002)
    assert served.verify_costs.gap(1) == pytest.approx(0.002)
    assert served.plan(requests("eagle3", 1)) == RoundPlan([0], 8)


def test_a_lookup_that_rarely_finds_drafts_lets_its_calls_run_several_plain_rounds_where_calls_cost_a_hop():
    """A prompt lookup that found nothing this round may find drafts the next, but one
    round a call costs a hop a round. The plan weighs the lookups it would skip (how often
    the sequence's lookups find drafts, and how much those are accepted) against the hops
    it would save: a lookup that rarely finds lets the call run ``plain_steps`` rounds; one
    that often finds drafts that are accepted keeps one round a call; and without a hop
    (in-process) there is nothing to save."""
    def planner(acceptance: float, hop: float) -> DraftLengthPlanner:
        plans = controller({"prompt_lookup": acceptance}, table=LAYOUT_TABLE)
        plans.plain_steps = 8
        for _ in range(20):
            plans.verify_costs.observe([1], LAYOUT_TABLE.predict(1, 1) + hop)
            plans.verify_costs.observe([5], LAYOUT_TABLE.predict(1, 5) + hop)
        return plans

    def steps_after(plans: DraftLengthPlanner, seq: str, found_every: int) -> int:
        for i in range(40):  # the lookups so far: drafts found every ``found_every`` rounds
            plans.plan([DraftRequest(seq, "prompt_lookup", 4 if i % found_every == 0 else 0, True, looked_up=4)])
        return plans.plan([DraftRequest(seq, "prompt_lookup", 0, True, looked_up=4)]).steps

    assert steps_after(planner(0.3, hop=0.003), "rare", found_every=20) == 8
    assert steps_after(planner(0.9, hop=0.003), "often", found_every=2) == 1
    assert steps_after(planner(0.3, hop=0.0), "in-process", found_every=20) == 1


def test_several_plain_rounds_priced_from_their_prior_need_a_wider_margin():
    """Until calls of several plain rounds have been seen at a batch size, their price is a
    prior (the first round's call, the others at the table's figure), optimistic at a large
    batch; so a drafting plan beats them there unless they are predicted MULTI_STEP_PRIOR_MARGIN
    faster, not just MULTI_STEP_MARGIN. Once such calls are seen at that same price,
    the narrower margin applies and they win."""
    plans = controller({"shared_kv": 0.7}, table=LAYOUT_TABLE)
    plans.plain_steps = 8
    hop = 0.004  # every call's fixed part: several rounds in one call pay it once
    for _ in range(20):
        plans.verify_costs.observe([1] * 32, LAYOUT_TABLE.predict(32, 32) + hop)
        plans.verify_costs.observe([5] * 32, LAYOUT_TABLE.predict(32, 160) + hop)
    batch = requests("shared_kv", 32)
    assert not plans.verify_costs.knows_multi_step(32)
    assert plans.plan(batch) == RoundPlan([2] * 32, 1)
    prior = plans.verify_costs.plain_rounds(32, 8) - 8 * plans.verify_costs.overhead(32)
    for _ in range(3):  # seen: exactly what the prior said
        plans.verify_costs.observe([1] * 32, prior, 8)
    assert plans.verify_costs.knows_multi_step(32)
    assert plans.plan(batch) == RoundPlan([0] * 32, 8)


@pytest.mark.parametrize("mode", ["eagle3", "shared_kv"])
def test_a_head_drafts_from_the_last_of_several_plain_rounds(mode, adaptive_engine, heldout_prompts, monkeypatch):
    """After a call of several plain rounds the head starts from the anchor of the last
    one (its hidden states, its KV slices), not the first: forced to alternate such
    calls with drafting rounds, a request keeps the target-only tokens and its drafts
    are accepted about as often as without them (from a stale anchor they would not be)."""
    options = GenerationOptions(max_new_tokens=48, ignore_eos=True, speculative_mode=mode)
    expected = [adaptive_engine.generate(p, options.model_copy(update={"speculative_mode": "none"})).token_ids
                for p in heldout_prompts[:3]]
    usual = [adaptive_engine.generate(p, options) for p in heldout_prompts[:3]]
    real_plan = DraftLengthPlanner.plan
    plans = []

    def plan(self, requests):  # every other plan: no drafts, four plain rounds in the call
        plans.append(len(requests))
        if len(plans) % 2:
            return RoundPlan([0] * len(requests), 4)
        return real_plan(self, requests)

    monkeypatch.setattr(DraftLengthPlanner, "plan", plan)
    mixed = [adaptive_engine.generate(p, options) for p in heldout_prompts[:3]]
    assert [r.token_ids for r in mixed] == expected
    assert sum(r.speculative.verification_steps for r in mixed) > 4 * sum(1 for r in mixed)  # plans really ran
    rate = lambda results: (sum(r.speculative.accepted_tokens for r in results)  # noqa: E731
                            / sum(r.speculative.proposed_tokens for r in results))
    assert rate(mixed) >= 0.8 * rate(usual), (rate(mixed), rate(usual))


@pytest.mark.parametrize("mode", ["eagle3", "shared_kv"])
def test_a_head_never_drafts_without_the_anchor_of_its_last_call(mode, adaptive_engine, heldout_prompts,
                                                                  monkeypatch):
    """Calls whose plan asks for no anchor bring none back (for ``shared_kv`` no KV
    slices either); a plan that then wants drafts first runs a plain round that brings
    the anchor back, so every proposal starts from the last call's anchor and the tokens
    stay the target's."""
    from specserve.engine.sched.proposer_worker import ProposerWorker

    options = GenerationOptions(max_new_tokens=48, ignore_eos=True, speculative_mode=mode)
    expected = [adaptive_engine.generate(p, options.model_copy(update={"speculative_mode": "none"})).token_ids
                for p in heldout_prompts[:3]]
    real_plan, real_propose = DraftLengthPlanner.plan, ProposerWorker.propose
    plans, anchors = [], []

    def plan(self, requests):  # every other plan: four plain rounds, no anchors brought back
        plans.append(len(requests))
        if len(plans) % 2:
            return RoundPlan([0] * len(requests), 4, [False] * len(requests))
        return real_plan(self, requests)

    def propose(self, items):
        anchors.extend(item.anchor for item in items)
        return real_propose(self, items)

    monkeypatch.setattr(DraftLengthPlanner, "plan", plan)
    monkeypatch.setattr(ProposerWorker, "propose", propose)
    results = [adaptive_engine.generate(p, options) for p in heldout_prompts[:3]]
    assert [r.token_ids for r in results] == expected
    assert sum(r.speculative.proposed_tokens for r in results) > 0 and anchors  # drafting still happened
    assert all(anchor is not None and not anchor.empty for anchor in anchors)
    assert all((anchor.shared_kv is not None) == (mode == "shared_kv") for anchor in anchors)


def test_a_call_queued_behind_another_lanes_call_counts_from_when_the_worker_started_on_it():
    """A worker serves one call at a time: a call sent while another lane's call to the
    same worker runs waits for it, and that wait is the other lane's work, not this plan's
    cost. Calls to other workers do not count against it."""
    now = [0.0]
    clock = SerialCallClock(lambda: now[0])
    first = clock.now()                 # lane 1 calls the target at 0 ...
    now[0] = 0.001
    second = clock.now()                # ... lane 2 at 1 ms, and queues behind it
    now[0] = 0.3
    assert clock.finished("target", first) == pytest.approx((0.3, 0.3))
    now[0] = 0.32
    assert clock.finished("target", second) == pytest.approx((0.319, 0.02))  # served from 300 ms on
    other = clock.now()
    now[0] = 0.33
    assert clock.finished("proposer", other) == pytest.approx((0.01, 0.01))
    alone = clock.now()
    now[0] = 0.36
    assert clock.finished("target", alone) == pytest.approx((0.03, 0.03))  # sent after the last one finished


def test_the_verify_table_is_piecewise_between_its_measured_rows():
    """At batch 1 a plain step runs the step graph and any wider call the verify graph: the
    cost jumps from 1 row to 2, then grows slowly. The table follows its measured points."""
    table = VerifyCostTable({(1, 1): 0.017, (1, 2): 0.026, (1, 5): 0.027, (4, 4): 0.04, (4, 20): 0.06})
    assert table.predict(1, 2) == pytest.approx(0.026)
    assert table.predict(1, 3) == pytest.approx(0.026 + 0.001 / 3)
    assert table.predict(1, 7) == pytest.approx(0.027 + 2 * 0.001 / 3)   # beyond: the last segment's slope
    assert table.predict(4, 8) == pytest.approx(0.04 + 0.02 / 4)         # two points: a line
