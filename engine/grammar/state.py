"""One sequence's place in its grammar: which tokens may come next, and moving on.

A ``GrammarState`` wraps an llguidance matcher. Verification asks it for the allowed
tokens at each position it reaches and advances it with each token it accepts, so the
matcher always stands exactly at the sequence's committed tokens: a draft the target
rejects is never consumed. ``rollback`` serves what drafts tentatively (a proposer that
drafts only allowed tokens steps through its own drafts, then returns), and ``replay``
rebuilds a state from committed tokens (a sequence re-prefilled on another target).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from specserve.engine.errors import EngineError


class GrammarError(EngineError):
    """A grammar refused a token it had allowed, or allows nothing more: never a state to
    decode on from (the request fails with this message)."""


class GrammarState:
    def __init__(self, matcher, vocab_size: int) -> None:
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        self._matcher, self.vocab_size = matcher, vocab_size
        self._fill = fill_next_token_bitmask
        self._bits = allocate_token_bitmask(1, vocab_size)
        self._allowed: np.ndarray | None = None  # the mask at the current position, once computed
        self.consumed = 0  # tokens the matcher has taken

    def allowed(self) -> np.ndarray:
        """A bool mask over the vocabulary: the tokens the grammar allows next (the
        end-of-sequence tokens exactly where the output may end)."""
        if self._allowed is None:
            self._check()
            self._fill(self._matcher, self._bits)
            mask = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab_size].astype(bool)
            if not mask.any():
                raise GrammarError("the grammar allows no next token")
            self._allowed = mask
        return self._allowed

    def advance(self, token: int) -> None:
        """Take ``token`` as the next output token; it must be one ``allowed`` allows."""
        if not self._matcher.consume_token(int(token)):
            raise GrammarError(f"the grammar refused token {token}: {self._matcher.get_error() or 'not allowed'}")
        self._allowed = None
        self.consumed += 1

    def replay(self, tokens: Sequence[int]) -> None:
        """Advance through ``tokens`` (already committed, so each was allowed)."""
        for token in tokens:
            self.advance(token)

    def rollback(self, count: int) -> None:
        """Undo the last ``count`` tokens taken."""
        if count > self.consumed or not self._matcher.rollback(count):
            raise GrammarError(f"cannot roll the grammar back {count} tokens: {self._matcher.get_error()}")
        self._allowed = None
        self.consumed -= count

    @property
    def stopped(self) -> bool:
        """Nothing but the end of the output can follow (the grammar is complete and cannot
        be extended, or the end-of-sequence token has been taken)."""
        return self._matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """The output so far is complete under the grammar (it may end here)."""
        return self._matcher.is_accepting()

    def _check(self) -> None:
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
