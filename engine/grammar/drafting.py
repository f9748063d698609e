"""Drafting under a grammar: a proposer drafts only tokens the grammar allows.

Nothing here affects exactness -- the target masks its own logits and rejects whatever
the grammar forbids (``speculative/verify.py``) -- it only makes drafts worth verifying:
a drafter that does not know the grammar proposes what the target can never accept.
A proposer worker keeps a grammar state per sequence at its committed tokens; for a
round it hands the proposer a ``DraftGuide``, which masks each draft step's logits with
what the grammar allows after the drafts before it, steps through the drafts, and is
rolled back to the committed tokens when the round's drafting is done.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from specserve.engine.grammar.state import GrammarError, GrammarState


class DraftGuide:
    def __init__(self, state: GrammarState) -> None:
        self.state = state
        self.taken = 0          # drafts stepped through this round
        self.stopped = False    # the grammar allows nothing after the last draft (it ended the output)

    def allowed(self) -> np.ndarray | None:
        """What the grammar allows for the next draft; None once drafting must stop."""
        if self.stopped:
            return None
        try:
            return self.state.allowed()
        except GrammarError:  # after an end-of-sequence draft: the output is over
            self.stopped = True
            return None

    def take(self, token: int) -> None:
        """Step through a draft. Once the grammar is stopped, what could follow is the end
        of the output, which the target's own token after the drafts gives: drafting stops."""
        self.state.advance(token)
        self.taken += 1
        if self.state.stopped:
            self.stopped = True

    def stop(self) -> None:
        self.stopped = True

    def keep(self, drafts: list[int]) -> list[int]:
        """The drafts worth verifying: none past the point where the grammar stopped them."""
        return drafts[: self.taken] if self.stopped else drafts

    def rewind(self) -> None:
        """Back to the committed tokens."""
        if self.taken:
            self.state.rollback(self.taken)
            self.taken = 0
        self.stopped = False


def guided_choice(logits: np.ndarray, guide: DraftGuide | None, target_ids: np.ndarray | None = None) -> int:
    """One draft: the argmax of ``logits`` over what ``guide`` allows (all of it without a
    guide), taken by the guide. ``target_ids`` maps a reduced draft vocabulary to the
    target's (a head's ``d2t``); the draft's own id is returned. A guide whose grammar
    allows none of the drafter's vocabulary stops (the argmax is returned, and dropped)."""
    if guide is None or guide.stopped:
        return int(np.argmax(logits))
    allowed = guide.allowed()
    if allowed is not None and target_ids is not None:
        allowed = allowed[target_ids]
    if allowed is None or not allowed.any():
        guide.stop()
        return int(np.argmax(logits))
    choice = int(np.argmax(np.where(allowed, logits, -np.inf)))
    guide.take(int(target_ids[choice]) if target_ids is not None else choice)
    return choice


def guided_choices(logits: np.ndarray, guides: Sequence[DraftGuide | None],
                   target_ids: np.ndarray | None = None) -> list[int]:
    """``guided_choice`` for each row of a batched head's ``[batch, vocab]`` logits."""
    if not any(g is not None for g in guides):
        return [int(t) for t in np.argmax(logits, axis=-1)]
    return [guided_choice(row, guide, target_ids) for row, guide in zip(logits, guides)]
