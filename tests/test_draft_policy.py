"""The draft-policy seam: the coordinator asks a policy to plan each tick's target calls
and reports each tick to it once; ``FixedDrafts`` and ``AdaptiveDrafts`` behind it."""
from __future__ import annotations

import pytest

from specserve.engine import Engine, GenerationOptions
from specserve.engine.sched.adaptive_drafts import AdaptiveDrafts
from specserve.engine.sched.draft_policy import FixedDrafts, ProposerCall, TickReport, tokens_behind

from .conftest import CPU_CONFIG, MODELS


class RecordingPolicy(FixedDrafts):
    """``FixedDrafts`` that keeps what the coordinator tells it: the seam seen from outside."""

    def __init__(self, plain_steps: int) -> None:
        super().__init__(plain_steps)
        self.reports: list[TickReport] = []

    def observe(self, report: TickReport) -> None:
        self.reports.append(report)


@pytest.fixture(scope="module")
def engine():
    with Engine(MODELS, CPU_CONFIG) as engine:
        yield engine


@pytest.fixture
def recording(engine):
    """The engine's coordinator under a recording policy for one test."""
    default = engine.coordinator.policy
    engine.coordinator.policy = policy = RecordingPolicy(engine.config.scheduler.plain_steps)
    yield policy
    engine.coordinator.policy = default


def test_a_policy_hears_every_tick_once_and_its_rounds_are_the_requests(engine, recording, heldout_prompts):
    """One report per tick, whose rounds are exactly the request's verify rounds (their
    drafts and acceptances sum to its stats), and whose retirements name it; under fixed
    drafts an adaptive request drafts its maximum, and the tokens stay target-only's."""
    options = GenerationOptions(max_new_tokens=32, ignore_eos=True, speculative_mode="eagle3",
                                num_speculative_tokens=4, adaptive_speculation=True)
    ticks = engine.coordinator.timings.ticks
    result = engine.generate(heldout_prompts[0], options)
    assert engine.drain()
    assert len(recording.reports) == engine.coordinator.timings.ticks - ticks
    rounds = [r for report in recording.reports for r in report.rounds]
    assert len(rounds) == result.speculative.verification_steps
    assert sum(r.num_drafts for r in rounds) == result.speculative.proposed_tokens
    assert sum(r.accepted for r in rounds) == result.speculative.accepted_tokens
    assert rounds[0].num_drafts == 4 and sum(r.num_drafts == 4 for r in rounds) >= len(rounds) - 3
    assert [seq for report in recording.reports for seq in report.retired] == [rounds[0].seq_id]
    assert all(len(report.proposer_calls) <= 1 and report.time is not None for report in recording.reports)
    expected = engine.generate(heldout_prompts[0], options.model_copy(update={"speculative_mode": "none"}))
    assert result.token_ids == expected.token_ids


def test_fixed_drafts_runs_target_only_calls_several_rounds_at_a_time(engine, recording, heldout_prompts):
    """A call of target-only sequences runs ``plain_steps`` rounds back to back."""
    steps = engine.config.scheduler.plain_steps
    assert steps > 1
    result = engine.generate(heldout_prompts[1], GenerationOptions(max_new_tokens=4 * steps, ignore_eos=True,
                                                                   speculative_mode="none"))
    calls = [call for report in recording.reports for call in report.target_calls if call.rows]
    assert [call.steps for call in calls] == [[steps]] * 3 + [[steps - 1]]  # the prefill made the first token
    assert len(result.token_ids) == 4 * steps


def test_adaptive_drafts_plans_only_once_a_request_adapts(engine, heldout_prompts):
    """A pinned request never makes the planner (nor fetches a cost table); the first
    adaptive request does, and the rounds then teach its cost model."""
    policy = AdaptiveDrafts(engine.transport, engine.config.scheduler.plain_steps,
                            engine.config.scheduler.replan_rounds)
    default, engine.coordinator.policy = engine.coordinator.policy, policy
    try:
        options = GenerationOptions(max_new_tokens=16, ignore_eos=True, speculative_mode="eagle3",
                                    adaptive_speculation=False)
        engine.generate(heldout_prompts[2], options)
        assert policy.planner is None
        engine.generate(heldout_prompts[2], options.model_copy(update={"adaptive_speculation": True}))
        assert policy.planner is not None and policy.planner.verify_costs.overheads
        assert "eagle3" in policy.planner.draft_costs.coefficients
    finally:
        engine.coordinator.policy = default


def test_a_proposer_call_prices_only_the_tokens_beyond_its_rounds():
    """A first contact feeds the whole context; a later call is behind by what rounds
    without drafts committed beyond one round's (``tokens_behind``)."""
    assert tokens_behind(0, 40, 4) == 40
    assert tokens_behind(12, 5, 4) == 0 and tokens_behind(12, 9, 4) == 4
    call = ProposerCall("draft_model", [4, 4], [0, 12], [40, 9], [4, 4], 0.01)
    assert call.catch_up_tokens == 44
