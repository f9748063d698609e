"""One target call's candidate plans priced: what the draft-length planner
(``sched.draft_length``) weighs each cap of a call with.

A plan's worth is the batch's size over its mean expected time per token, from each
sequence's live acceptance (``sched.acceptance``) and the measured, online-corrected
costs of the target's verify pass and of each proposer's call (``sched.cost_models``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from specserve.engine.sched.acceptance import AcceptanceTracker
from specserve.engine.sched.cost_models import DraftCostModel, VerifyCostModel

CATCH_UP_STEPS = 0.15    # a draft model's step-equivalents per token of catch-up until calls that carried
                         # catch-ups have priced it (``DraftCostModel.catch_up_token``): it feeds them in one
                         # batched pass, so a token costs a fraction of a step (docs/adaptive-speculation.md)


@dataclass(frozen=True)
class DraftRequest:
    """One sequence's entry in a round's plan."""

    seq_id: object
    mode: str
    max_num_drafts: int  # the most this round may draft (the request's num_drafts, capped by length/context)
    adaptive: bool       # False: the request pinned its num_drafts, and drafts max_num_drafts
    catch_up: float = 0.0  # tokens a draft model must feed before it drafts, beyond a round's,
                           # per round the request has left (``adaptive_drafts.catch_up``)
    ending: bool = False   # the request's budget has one token left: max_num_drafts is 0 for its sake,
                           # not for want of drafts, and several plain rounds cost it nothing
    cold: bool = False     # its proposer has not seen the sequence yet (``adaptive_drafts.proposer_cold``)
    looked_up: int = 0     # a proposer in the coordinator looked for up to this many drafts before the plan
                           # (prompt lookup); max_num_drafts is then what it found
    primed: bool = True    # its proposer could draft now: it needs no anchor, or holds the one its sequence's
                           # last target call brought back (``DraftLengthPlanner.plan``: anchors on demand)
    draft_class: str = ""  # the class of the drafts it found (``Proposal.draft_class``; "" unclassed)
    lag: int = 0           # tokens a draft model must feed before it drafts, in all (the whole context
                           # where it has not seen the sequence): what exploring from 0 pays first


def catch_up_seconds(draft_costs: DraftCostModel, mode: str, tokens: float) -> float:
    """Seconds a draft model spends catching up on ``tokens`` (a head restarts every pass:
    it has none)."""
    if not tokens or mode in draft_costs.heads:
        return 0.0
    return tokens * draft_costs.catch_up_token(mode, CATCH_UP_STEPS)


class CallPricing:
    """One target call's plans priced from tables made once per plan: each sequence's
    expected tokens for every draft count (prefix products of its alphas), its draft-model
    step and catch-up, and the call's verify and proposer costs as functions bound once:
    a plan weighs every cap of its call, and none of these depends on the cap."""

    def __init__(self, acceptance: AcceptanceTracker, verify_costs: VerifyCostModel, draft_costs: DraftCostModel,
                 requests: Sequence[DraftRequest]) -> None:
        self.requests = requests
        # per request: P(drafts 1..j+1 all accepted), the tokens draft j+1 adds on average
        self.prefix_accepted: list[list[float]] = []
        # per request: target calls per committed token with n drafts, 1 / expected tokens
        self.calls_per_token: list[list[float]] = []
        for r in requests:
            accepted, tokens, prefix_accepted, calls_per_token = 1.0, 1.0, [], [1.0]
            for alpha in acceptance.alphas(r.seq_id, r.mode, r.max_num_drafts, r.draft_class):
                accepted *= alpha
                tokens += accepted
                prefix_accepted.append(accepted)
                calls_per_token.append(1.0 / tokens)
            self.prefix_accepted.append(prefix_accepted)
            self.calls_per_token.append(calls_per_token)
        self.catch_up_s = [_catch_up_s(draft_costs, r) for r in requests]
        # A draft model's step, where pruning applies (adaptive, not a head, a measured step)
        self.draft_step_s = [draft_costs.marginal_step(r.mode) if r.adaptive and r.mode not in draft_costs.heads
                             else 0.0 for r in requests]
        self.verify_s = verify_costs.round_prices(len(requests))  # rows -> seconds
        self.modes = list(dict.fromkeys(r.mode for r in requests))
        self.mode_of = [self.modes.index(r.mode) for r in requests]
        self.draft_s = [draft_costs.prices(mode) for mode in self.modes]  # (n, steps, tokens) -> seconds

    def under_caps(self, caps: dict[str, int]) -> tuple[list[int], float]:
        """Each sequence's draft count under its mode's cap, and the plan's worth."""
        num_drafts = [min(r.max_num_drafts, caps.get(r.mode, r.max_num_drafts)) if r.adaptive else r.max_num_drafts
                      for r in self.requests]
        rate = self.rate(num_drafts)
        # A batched verify pads every sequence to the call's longest, so below the longest a
        # draft costs no target row; what it can still cost is a draft model's step. Drop
        # the trailing drafts whose expected tokens do not pay for that at the batch's rate.
        # A draft model that sat out rounds (or never saw the sequence) first feeds what it
        # missed: its first draft also pays for that catch-up (spread over the rounds left).
        pruned = False
        for i, step in enumerate(self.draft_step_s):
            if step == 0.0:
                continue
            keep, prefix_accepted = 0, self.prefix_accepted[i]
            for j in range(num_drafts[i]):
                if prefix_accepted[j] < rate * (step + (self.catch_up_s[i] if j == 0 else 0.0)):
                    break
                keep = j + 1
            if keep < num_drafts[i]:
                num_drafts[i], pruned = keep, True
        return num_drafts, self.rate(num_drafts) if pruned else rate

    def rate(self, num_drafts: list[int]) -> float:
        """A plan's worth as tokens per second: the batch's size over its mean expected
        time per token (sum_s E_s / T when every sequence commits alike)."""
        calls_per_token, catch_up_s, widest = 0.0, 0.0, 0  # catch_up_s: draft models catching up first
        counts = [0] * len(self.modes)  # per mode: drafting sequences, their longest draft count, their drafts
        longest, drafts = counts[:], counts[:]
        for i, n in enumerate(num_drafts):
            calls_per_token += self.calls_per_token[i][n]
            if n > 0:
                m = self.mode_of[i]
                counts[m] += 1
                drafts[m] += n
                if n > longest[m]:
                    longest[m] = n
                catch_up_s += self.catch_up_s[i]
                if n > widest:
                    widest = n
        sequences = len(num_drafts)
        seconds = self.verify_s(sequences * (widest + 1)) + catch_up_s  # padded to the longest
        for m, count in enumerate(counts):
            if count:
                seconds += self.draft_s[m](count, longest[m], drafts[m])
        expected = sequences ** 2 / calls_per_token if calls_per_token else 0.0
        return expected / seconds if seconds > 0 else float("inf")


def _catch_up_s(draft_costs: DraftCostModel, r: DraftRequest) -> float:
    """Seconds a draft model's catch-up adds to this round if the sequence drafts: its
    share of the request's rounds left (``DraftRequest.catch_up``)."""
    return catch_up_seconds(draft_costs, r.mode, r.catch_up)
