"""Suffix decoding: the index drafts what a depth-limited suffix tree's counts say, the
shared cache stays bounded, and through the engine a request drafts from earlier outputs
-- never changing a token."""
from __future__ import annotations

import pytest

from specserve.engine import GenerationOptions
from specserve.engine.speculative.proposers.base import ProposerContext
from specserve.engine.speculative.proposers.suffix import SuffixProposer
from specserve.engine.speculative.suffix_index import SuffixCache, SuffixParams, TokenIndex

from .conftest import assert_everything_released

PARAMS = SuffixParams(max_depth=24, max_spec_factor=1.0, min_token_prob=0.1, min_match=2)


def _draft(history: list[int], context: list[int], max_tokens: int = 16, params: SuffixParams = PARAMS):
    index = TokenIndex()
    index.extend(7, history)
    return index.speculate(context, max_tokens, params)


def test_the_longest_match_drafts_as_far_as_it_is_long():
    history = [5, 6, 1, 2, 3, 4, 10, 11, 12, 13, 14, 15]
    draft = _draft(history, [9, 1, 2, 3])
    assert draft.tokens == [4, 10, 11] and draft.match_len == 3  # factor 1.0: a 3-token match drafts 3
    assert draft.probs == [1.0, 1.0, 1.0]
    longer = _draft(history, [6, 1, 2, 3, 4])
    assert longer.tokens == [10, 11, 12, 13, 14] and longer.match_len == 5
    assert _draft(history, [9, 1, 2, 3], params=SuffixParams(max_spec_factor=0.5, min_match=2)).tokens == [4]


def test_counts_give_each_token_its_probability_and_cut_below_the_minimum():
    # "1 2" continues with 3 twice and with 4 once; after "1 2 3" always 7.
    history = [1, 2, 3, 7, 0, 1, 2, 3, 7, 0, 1, 2, 4, 8, 0]
    offset = SuffixParams(max_spec_offset=1.0, min_match=2)  # a 2-token match may draft 3
    draft = _draft(history, [9, 1, 2], params=offset)
    assert draft.tokens == [3, 7, 0] and draft.probs == pytest.approx([2 / 3, 2 / 3, 2 / 3])
    assert draft.score == pytest.approx(2.0)
    assert _draft(history, [9, 1, 2], params=SuffixParams(min_token_prob=0.7, min_match=2)).tokens == []
    # "0 1 2" matches two occurrences, split 3 / 4: its 3-token draft (score 1.5) beats
    # the 2-token match's (2 x 2/3), and the tie goes to the most recent.
    longer = _draft(history, [0, 1, 2])
    assert longer.tokens == [4, 8, 0] and longer.probs == pytest.approx([0.5] * 3) and longer.match_len == 3


def test_matches_shorter_than_the_minimum_draft_nothing():
    history = [5, 6, 1, 2, 3, 4, 10, 11, 12, 13]
    assert _draft(history, [9, 1, 2], params=SuffixParams(min_match=3)).tokens == []
    assert _draft(history, [9, 2, 3], params=SuffixParams(min_match=2)).tokens == [4, 10]
    assert _draft(history, [6, 1, 2], params=SuffixParams(min_match=3)).tokens == [3, 4, 10]


def test_ties_go_to_the_most_recent_occurrence_and_depth_bounds_match_plus_draft():
    assert _draft([1, 2, 3, 9, 1, 2, 4, 9], [1, 2]).tokens == [4, 9]
    history = list(range(100, 160))
    context = history[:20]  # its best draft counts 12 of its 20 tokens as the match: 12 + 12 = depth 24
    assert _draft(history, context, params=SuffixParams(max_depth=24, min_match=2)).tokens == history[20:32]
    assert _draft([1, 2], [1, 2]).tokens == []  # the match ends the history: nothing follows


def test_a_request_drafts_from_its_own_history_never_from_its_own_end():
    proposer = SuffixProposer(PARAMS, prompt_len=6)
    context = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    proposal = proposer.propose(ProposerContext(num_drafts=8, context_tokens=context, options=GenerationOptions()))
    assert proposal.tokens == [4, 5, 6]
    alone = SuffixProposer(PARAMS, prompt_len=3)
    assert alone.propose(ProposerContext(4, [8, 1, 2], GenerationOptions())).tokens == []


def test_a_finished_output_is_drafted_from_by_the_next_request_and_the_cache_stays_bounded():
    cache = SuffixCache(max_cached_requests=2)
    first = SuffixProposer(PARAMS, prompt_len=2, shared=cache)
    first.propose(ProposerContext(4, [50, 51, 1, 2, 3, 4, 5], GenerationOptions()))
    first.close()  # its output, not its prompt, joins the cache
    assert len(cache) == 1 and cache.index.tokens == 5
    second = SuffixProposer(PARAMS, prompt_len=3, shared=cache)
    assert second.propose(ProposerContext(4, [60, 1, 2, 3], GenerationOptions())).tokens == [4, 5]
    assert second.propose(ProposerContext(4, [60, 50, 51], GenerationOptions())).tokens == []  # a prompt is private
    for n in range(50):
        cache.add([n, n + 1, n + 2, n + 3])
    assert len(cache) == 2 and cache.index.tokens == 8
    assert cache.index.entries <= 3 * cache.index.tokens  # removed outputs' entries are compacted away
    assert SuffixProposer(PARAMS, 1, cache).propose(ProposerContext(4, [9, 1, 2], GenerationOptions())).tokens == []
    cache.clear()
    assert len(cache) == 0
    none_kept = SuffixCache(max_cached_requests=0)
    none_kept.add([1, 2, 3])
    assert len(none_kept) == 0


def test_the_engine_drafts_from_earlier_outputs_and_a_reset_forgets_them(bundle_engine, heldout_prompts):
    """A second request for the same text finds the first one's output in the suffix
    cache (a cache hit: many more tokens a round); after a reset it runs cold again.
    Every run gives target-only's tokens."""
    options = GenerationOptions(max_new_tokens=48, ignore_eos=True, speculative_mode="suffix",
                                adaptive_speculation=False)
    plain = bundle_engine.generate(heldout_prompts[4], options.model_copy(update={"speculative_mode": "none"}))
    bundle_engine.reset_suffix_cache()
    cold = bundle_engine.generate(heldout_prompts[4], options)
    hit = bundle_engine.generate(heldout_prompts[4], options)
    assert bundle_engine.reset_suffix_cache() == 2
    again = bundle_engine.generate(heldout_prompts[4], options)
    assert cold.token_ids == hit.token_ids == again.token_ids == plain.token_ids
    assert hit.speculative.mean_accepted_length > 2 * cold.speculative.mean_accepted_length
    assert (again.speculative.verification_steps, again.speculative.accepted_tokens) == \
        (cold.speculative.verification_steps, cold.speculative.accepted_tokens)
    stats = hit.speculative
    assert stats.lookups == stats.verification_steps and stats.hit_rate > 0.5
    assert_everything_released(bundle_engine)
