"""Model-free prompt lookup (n-gram copy), behaving as ``NgramProposer`` in ``speculative.rs``."""
from __future__ import annotations

from specserve.engine.config import SpeculativeConfig
from specserve.engine.speculative.proposers.base import Proposal, Proposer, ProposerContext, StatelessProposer
from specserve.engine.speculative.proposers.mode import ProposerMode


class PromptLookupProposer(StatelessProposer):
    """Find the most recent earlier occurrence of the last ``ngram`` tokens and propose
    up to ``max_tokens`` of the tokens that followed it."""

    name = "prompt_lookup"

    def __init__(self, ngram: int = 3, max_tokens: int = 4) -> None:
        if ngram <= 0:
            raise ValueError("ngram must be greater than zero")
        if max_tokens <= 0:
            raise ValueError("max_tokens must be greater than zero")
        self.ngram, self.max_tokens = ngram, max_tokens

    def propose(self, context: ProposerContext) -> Proposal:
        return Proposal(self.lookup(context.context_tokens, context.num_drafts))

    def lookup(self, tokens, num_drafts: int) -> list[int]:
        tokens = list(tokens)
        n = self.ngram
        if len(tokens) <= n:
            return []
        suffix_start = len(tokens) - n
        suffix = tokens[suffix_start:]
        for start in range(suffix_start - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                continuation = start + n
                length = min(num_drafts, self.max_tokens, len(tokens) - continuation)
                return tokens[continuation : continuation + length]
        return []


class PromptLookupMode(ProposerMode):
    mode = "prompt_lookup"
    description = "n-gram copy from the context (no model)"

    def local_proposer(self, speculative: SpeculativeConfig, num_drafts: int, prompt_len: int = 0,
                       shared: object | None = None) -> Proposer:
        return PromptLookupProposer(speculative.prompt_lookup_ngram, num_drafts)
