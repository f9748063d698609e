"""Adaptive speculation as a draft policy: the ``DraftLengthPlanner`` behind the seam.

``AdaptiveDrafts`` plans the calls in which some request adapts (``SequenceDriver.adaptive``)
with a ``DraftLengthPlanner``, made when the first such request arrives from the target's
measured verify costs, and hands it each proposer mode's measured costs when the mode first
adapts. A call in which nothing adapts is planned as ``FixedDrafts`` plans it. What the
planner weighs about a sequence besides its drafts -- a draft model's catch-up, whether its
proposer has seen the sequence, whether it holds its anchor -- is read off the driver here,
so the driver carries no planner state.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from specserve.engine.sched.call_pricing import DraftRequest
from specserve.engine.sched.cost_tables import DraftCostTable, VerifyCostTable
from specserve.engine.sched.draft_length import DraftCosts, DraftLengthPlanner, SequenceRetired
from specserve.engine.sched.draft_policy import FixedDrafts, RoundPlan, TickReport, most_drafts, tokens_behind
from specserve.engine.sched.sequence_driver import SequenceDriver
from specserve.engine.speculative.proposers.registry import HEAD_MODES

ROUND_TOKENS = 2.0  # tokens a drafting round commits, roughly: what a catch-up is spread over


class MeasuredCosts(Protocol):
    """Where the measured cost tables come from (the coordinator's transport)."""

    async def verify_costs(self) -> VerifyCostTable: ...

    async def draft_costs(self, mode: str) -> DraftCostTable: ...


def lag(driver: SequenceDriver) -> int:
    """Tokens a remote proposer must feed before it drafts this round beyond what one round
    commits: the whole context at first contact."""
    if not driver.remote_proposer:
        return 0
    seen = driver.proposer_seen
    return tokens_behind(seen, len(driver.state.tokens) - seen, driver.num_drafts)


def catch_up(driver: SequenceDriver, behind: int) -> float:
    """The tokens it is ``behind`` (``lag``: what rounds without drafts committed, or the
    whole context at first contact) spread over the rounds the request has left: drafting
    now buys every later round's drafts, so a catch-up is a one-off, not this round's cost
    (near the end of a request it is not worth it)."""
    if not behind:
        return 0.0
    state = driver.state
    left = state.options.max_new_tokens - (len(state.tokens) - state.prompt_len)
    return behind / max(1.0, left / ROUND_TOKENS)


def proposer_cold(driver: SequenceDriver) -> bool:
    """A remote proposer has not seen the sequence (or lost it): drafting now hands it the
    whole context."""
    return driver.remote_proposer and driver.prefilled and not driver.proposer_seen


def primed(driver: SequenceDriver) -> bool:
    """Its proposer could draft this round: it takes nothing from the target, or the last
    target call brought back the anchor it starts from (a plan asks for anchors only where
    the next round may draft: ``DraftLengthPlanner.plan``)."""
    return not driver.remote_proposer or not driver.needs.takes_anchor or driver.anchor is not None


def draft_request(driver: SequenceDriver) -> DraftRequest:
    """A sequence's entry in its call's plan."""
    behind = lag(driver)
    return DraftRequest(driver.seq_id, driver.mode, most_drafts(driver), driver.adaptive, catch_up(driver, behind),
                        driver.ending, proposer_cold(driver),
                        driver.max_num_drafts() if driver.local_proposer is not None else 0,
                        primed(driver), driver.draft_class, behind)


class AdaptiveDrafts:
    """Adaptive requests' drafts from the planner; pinned and target-only calls as fixed."""

    def __init__(self, costs: MeasuredCosts, plain_steps: int = 1, replan_rounds: int = 1) -> None:
        self.costs, self.replan_rounds = costs, replan_rounds
        self.fixed = FixedDrafts(plain_steps)
        self.planner: DraftLengthPlanner | None = None  # made when a request first adapts
        self._costed_modes: set[str] = set()  # modes whose measured draft costs the planner has

    async def plan(self, calls: Sequence[Sequence[SequenceDriver]]) -> list[RoundPlan]:
        adaptive = [driver for call in calls for driver in call if driver.adaptive]
        if adaptive:
            await self._learn_costs(adaptive)
        return [self.planner.plan([draft_request(driver) for driver in call])
                if any(driver.adaptive for driver in call) else self.fixed.plan_call(call)
                for call in calls]

    async def _learn_costs(self, adaptive: list[SequenceDriver]) -> None:
        """Make the planner, and give it each newly adapting proposer mode's measured costs."""
        if self.planner is None:
            self.planner = DraftLengthPlanner.for_target(await self.costs.verify_costs(), HEAD_MODES,
                                                         self.fixed.plain_steps, self.replan_rounds)
        for mode in {driver.mode for driver in adaptive if driver.remote_proposer} - self._costed_modes:
            self._costed_modes.add(mode)
            self.planner.observe(DraftCosts(mode, await self.costs.draft_costs(mode)))

    def observe(self, report: TickReport) -> None:
        planner = self.planner
        if planner is None:
            return  # no request has adapted yet: nothing is planned from what calls cost
        for record in (*report.proposer_calls, *report.target_calls, *report.rounds):
            planner.observe(record)
        for seq_id in report.retired:
            planner.observe(SequenceRetired(seq_id))
        if report.time is not None:
            planner.observe(report.time)
