"""Model-free suffix decoding (SuffixDecoding, ArcticInference; vLLM's ``method: suffix``).

Each request drafts from two histories: its own tokens (prompt and output so far) and
the outputs of the coordinator's earlier suffix-mode requests (``SuffixCache``), taking
whichever draft scores higher. Its draft length follows the match: a long match drafts
long, a short or ambiguous one little or nothing (``suffix_index.py``). A request's
output joins the shared history when it ends (``close``).
"""
from __future__ import annotations

from typing import Sequence

from specserve.engine.config import SpeculativeConfig
from specserve.engine.speculative.proposers.base import AcceptContext, Proposal, Proposer, ProposerContext, StatelessProposer
from specserve.engine.speculative.proposers.mode import ProposerMode
from specserve.engine.speculative.suffix_index import SuffixCache, SuffixParams, TokenIndex

OWN = 0  # the request's own sequence id in its private index


# Drafts of longer matches are accepted far more often: over the task suite, a first
# draft 0.36 of the time after a 2-token match, 0.5 after 3-4, 0.8 after 5-7, 0.95 after
# 8 or more (docs/speculative-decoding.md#suffix-decoding); under 3 they draft nothing
# (``SuffixParams.min_match``). The planner learns each class apart.
MATCH_CLASSES = ((8, "match8+"), (5, "match5-7"), (3, "match3-4"), (0, "match2"))


def match_class(match_len: int) -> str:
    return next(name for least, name in MATCH_CLASSES if match_len >= least)


class SuffixProposer(StatelessProposer):
    name = "suffix"

    def __init__(self, params: SuffixParams, prompt_len: int, shared: SuffixCache | None = None) -> None:
        self.params, self.prompt_len, self.shared = params, prompt_len, shared
        self.own = TokenIndex()
        self._tokens: list[int] = []  # what ``own`` holds: the committed tokens seen so far

    def propose(self, context: ProposerContext) -> Proposal:
        tokens = context.context_tokens
        self._catch_up(tokens)
        window = self._tokens[-self.params.max_depth:]
        draft = self.own.speculate(window, context.num_drafts, self.params, skip=(OWN, len(self._tokens) - 1))
        if self.shared is not None:
            other = self.shared.speculate(window, context.num_drafts, self.params)
            if other.score > draft.score:
                draft = other
        return Proposal(context.kept(draft.tokens), draft_class=match_class(draft.match_len))

    def _catch_up(self, tokens: Sequence[int]) -> None:
        """Index the committed tokens this proposer has not seen (all of them at first)."""
        seen = len(self._tokens)
        if len(tokens) < seen or (seen and int(tokens[seen - 1]) != self._tokens[-1]):
            self.own, self._tokens, seen = TokenIndex(), [], 0  # a rewritten history: start over
        new = [int(t) for t in tokens[seen:]]
        self.own.extend(OWN, new)
        self._tokens.extend(new)

    def accept(self, context: AcceptContext) -> None:
        self._catch_up(context.target_tokens)

    def rewind(self, target_tokens: Sequence[int]) -> None:
        self._catch_up(target_tokens)

    def close(self) -> None:
        """The request ended: its output joins the shared history."""
        if self.shared is not None:
            self.shared.add(self._tokens[self.prompt_len:])


class SuffixMode(ProposerMode):
    mode = "suffix"
    description = "suffix decoding over the request's own tokens and earlier outputs (no model)"

    def default_num_drafts(self, speculative: SpeculativeConfig) -> int:
        return speculative.suffix_num_speculative_tokens

    def coordinator_state(self, speculative: SpeculativeConfig) -> SuffixCache:
        return SuffixCache(speculative.suffix_max_cached_requests)

    def local_proposer(self, speculative: SpeculativeConfig, num_drafts: int, prompt_len: int = 0,
                       shared: object | None = None) -> Proposer:
        params = SuffixParams(speculative.suffix_max_depth, speculative.suffix_max_spec_factor,
                              speculative.suffix_max_spec_offset, speculative.suffix_min_token_prob,
                              speculative.suffix_min_match)
        return SuffixProposer(params, prompt_len, shared if isinstance(shared, SuffixCache) else None)
