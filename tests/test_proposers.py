"""Ports of the seed's proposer unit tests, run against the bundled heads and real caches."""
from __future__ import annotations

import numpy as np
import pytest

from engine import GenerationOptions
from engine.model.heads import load_head
from engine.kv.paged_cache import LayerGeometry, PagedKVCache
from engine.spec.proposers.base import AcceptContext, Proposal, ProposerContext, StatelessProposer
from engine.spec.proposers.eagle3 import Eagle3Proposer
from engine.spec.proposers.mtp import MtpProposer
from engine.spec.proposers.prompt_lookup import PromptLookupProposer
from engine.spec.proposers.shared_kv import SharedKvProposer, shared_kv_slices
from engine.spec.rounds import decode
from engine.spec.sequence import SequenceState
from engine.spec.stats import SpeculativeStats

from .conftest import MODELS

OPTIONS = GenerationOptions()


def context(tokens, width, **extra) -> ProposerContext:
    return ProposerContext(width=width, context_tokens=tokens, generated_tokens=[], generated_text="", step=0,
                           options=OPTIONS, **extra)


# -- prompt lookup (seed: ngram_proposer_*) -------------------------------------------------
def test_ngram_copies_most_recent_matching_continuation():
    assert PromptLookupProposer(2, 4).lookup([7, 8, 9, 4, 7, 8], 3) == [9, 4, 7]
    # Through the protocol, width counts the bonus token too: width 4 = 3 drafts.
    assert PromptLookupProposer(2, 4).propose(context([7, 8, 9, 4, 7, 8], 4)).tokens == [9, 4, 7]


def test_ngram_prefers_the_most_recent_occurrence():
    assert PromptLookupProposer(1, 2).lookup([5, 1, 5, 2, 5], 2) == [2, 5]


def test_ngram_validates_configuration_and_empty_matches():
    with pytest.raises(ValueError, match="^ngram must be greater than zero$"):
        PromptLookupProposer(0, 1)
    with pytest.raises(ValueError, match="^max_tokens must be greater than zero$"):
        PromptLookupProposer(1, 0)
    proposer = PromptLookupProposer(2, 4)
    assert proposer.lookup([1, 2], 4) == []
    assert proposer.lookup([1, 2, 3, 4], 4) == []
    assert proposer.name == "prompt_lookup"


def test_ngram_respects_request_and_config_widths():
    assert PromptLookupProposer(2, 2).lookup([1, 2, 3, 4, 1, 2], 8) == [3, 4]
    assert PromptLookupProposer(2, 8).lookup([1, 2, 3, 4, 1, 2], 1) == [3]


# -- shared-KV slices (seed: shared_kv_slices_pick_per_layer_geometry) ----------------------
def test_shared_kv_slices_pick_per_layer_geometry():
    cache = PagedKVCache([LayerGeometry(2, 8), LayerGeometry(3, 16)], num_blocks=4, block_size=4)
    cache.add_sequence("s")
    seq_len = 2
    sliding_key = np.arange(2 * seq_len * 8, dtype=np.float32).reshape(2, seq_len, 8)
    full_key = np.arange(3 * seq_len * 16, dtype=np.float32).reshape(3, seq_len, 16) + 2000
    cache.append("s", [sliding_key, full_key], [sliding_key + 1000, full_key + 1000])
    sliding, full = shared_kv_slices(cache, "s", {"sliding_attention": 0, "full_attention": 1})
    assert (sliding.group, sliding.kv_heads, sliding.head_dim, sliding.kv_len) == ("sliding_attention", 2, 8, 2)
    assert (full.group, full.kv_heads, full.head_dim, full.kv_len) == ("full_attention", 3, 16, 2)
    np.testing.assert_array_equal(sliding.key[0], sliding_key)
    np.testing.assert_array_equal(sliding.value[0], sliding_key + 1000)
    np.testing.assert_array_equal(full.key[0], full_key)
    np.testing.assert_array_equal(full.value[0], full_key + 1000)
    with pytest.raises(IndexError, match="group 'oob' references target layer 9 but only 2 layers exist"):
        shared_kv_slices(cache, "s", {"oob": 9})


# -- heads with the bundled weights ---------------------------------------------------------
@pytest.fixture(scope="module")
def target_state(bundle_engine, heldout_prompts):
    """Hidden states the target exposes after prefilling a held-out prompt."""
    target = bundle_engine.target
    ids = target.encode_prompt(heldout_prompts[9])
    target.cache.add_sequence("probe")
    try:
        out = target.feed("probe", ids, 0)
        slices = shared_kv_slices(target.cache, "probe", bundle_engine.heads["shared_kv"].config["shared_kv_groups"])
    finally:
        target.cache.free("probe")
    names = bundle_engine.heads["eagle3"].config["target_hidden_inputs"]["fused_hidden"]
    guaranteed = int(np.argmax(out.logits[-1]))
    return dict(tokens=ids + [guaranteed], final=out.extras["hidden_states"][-1],
                layers=tuple(out.extras[n][-1] for n in names), slices=slices)


def test_mtp_proposer_uses_real_head_and_returns_k_drafts(bundle_engine, target_state):
    proposer = MtpProposer(bundle_engine.heads["mtp"])
    proposal = proposer.propose(context(target_state["tokens"], 5, target_hidden=target_state["final"]))
    assert proposer.name == "mtp" and len(proposal.tokens) == 4 and proposal.probs is None
    assert all(0 <= t < bundle_engine.target.decoder.vocab_size for t in proposal.tokens)
    assert proposer.past_len == 4  # one head-KV entry per draft step
    with pytest.raises(ValueError, match="last hidden state"):
        proposer.propose(context(target_state["tokens"], 5))


def test_eagle3_proposer_returns_shape_correct_target_ids(bundle_engine, target_state):
    proposer = Eagle3Proposer(bundle_engine.heads["eagle3"])
    proposal = proposer.propose(context(target_state["tokens"], 4, target_hidden=target_state["final"],
                                        target_hidden_layers=target_state["layers"]))
    assert proposer.name == "eagle3" and len(proposal.tokens) == 3
    draft_vocab = bundle_engine.heads["eagle3"].config["draft_vocab_size"]
    allowed = set((np.arange(draft_vocab) + bundle_engine.heads["eagle3"].d2t).tolist())
    assert set(proposal.tokens) <= allowed  # mapped from the reduced draft vocabulary
    with pytest.raises(ValueError, match="exactly three target hidden states"):
        proposer.propose(context(target_state["tokens"], 4, target_hidden_layers=target_state["layers"][:2]))


def test_eagle3_accept_then_propose_resets_draft_state(bundle_engine, target_state):
    proposer = Eagle3Proposer(bundle_engine.heads["eagle3"])
    ctx = context(target_state["tokens"], 3, target_hidden=target_state["final"],
                  target_hidden_layers=target_state["layers"])
    first = proposer.propose(ctx)
    proposer.accept(AcceptContext(2, first.tokens[:2], list(target_state["tokens"]) + first.tokens[:2]))
    assert proposer.propose(ctx) == first


def test_shared_kv_proposer_bootstraps_then_drafts(bundle_engine, target_state):
    proposer = SharedKvProposer(bundle_engine.heads["shared_kv"])
    ctx = context(target_state["tokens"], 4, target_hidden=target_state["final"], shared_kv=target_state["slices"])
    proposal = proposer.propose(ctx)
    assert proposer.name == "shared_kv" and len(proposal.tokens) == 3  # bootstrap step's draft discarded
    assert proposer.propose(ctx) == proposal  # no state of its own
    with pytest.raises(ValueError, match="shared-KV slices"):
        proposer.propose(context(target_state["tokens"], 4, target_hidden=target_state["final"]))


def test_heads_reject_a_target_of_another_width(bundle_engine):
    from engine.errors import ModelLoadError
    with pytest.raises(ModelLoadError, match="embed_tokens.npy has shape"):
        load_head("mtp", MODELS / "heads/mtp", bundle_engine.target.decoder.vocab_size, 999, "cpu")


# -- the protocol supports non-model sources (seed: speculative_proposer_trait_*) -----------
class StubProposer(StatelessProposer):
    """Proposes fixed tokens; records what the round loop tells it."""

    name = "stub"

    def __init__(self, tokens):
        self.tokens, self.accepted, self.widths = tokens, [], []

    def propose(self, ctx):
        self.widths.append(ctx.width)
        return Proposal(list(self.tokens))

    def accept(self, ctx):
        self.accepted.append((ctx.accepted_prefix_len, list(ctx.committed_tokens), len(ctx.target_tokens)))


def test_round_loop_drives_any_proposer_and_reports_acceptance(bundle_engine, heldout_prompts):
    target = bundle_engine.target
    prompt = target.encode_prompt(heldout_prompts[11])
    expected = bundle_engine.generate(prompt, GenerationOptions(max_new_tokens=6, ignore_eos=True)).token_ids
    stub = StubProposer(expected[1:3] + [0])  # right, right, then wrong
    state = SequenceState(prompt, GenerationOptions(max_new_tokens=6, ignore_eos=True), target.tokenizer,
                          target.eos_token_ids, target.max_context)
    target.cache.add_sequence("stub")
    try:
        decode(target, "stub", state, stub, 3, np.random.default_rng(0), SpeculativeStats())
    finally:
        target.cache.free("stub")
    assert state.generated == expected
    assert stub.accepted[0] == (2, expected[1:4], len(prompt) + 4)
    assert stub.widths[0] == 4 and stub.widths[-1] <= 6 - 4 + 1


def test_a_full_draft_pool_means_no_drafts_not_a_failed_request(bundle_engine, heldout_prompts):
    from engine.model.cached_decoder import CachedDecoder
    from engine.options import EngineConfig
    from engine.spec.proposers.draft_model import DraftModelProposer

    tiny_draft = CachedDecoder(MODELS / "draft", EngineConfig(device="cpu", kv_num_blocks=2, kv_block_size=16))
    target = bundle_engine.target
    prompt = target.encode_prompt(heldout_prompts[12])
    assert len(prompt) > 32  # more than the tiny pool holds
    options = GenerationOptions(max_new_tokens=12, ignore_eos=True)
    expected = bundle_engine.generate(prompt, options).token_ids
    state = SequenceState(prompt, options, target.tokenizer, target.eos_token_ids, target.max_context)
    stats = SpeculativeStats()
    proposer = DraftModelProposer(tiny_draft)
    target.cache.add_sequence("tiny")
    try:
        decode(target, "tiny", state, proposer, 4, np.random.default_rng(0), stats)
    finally:
        target.cache.free("tiny")
        proposer.close()
    assert state.generated == expected and stats.proposed_tokens == 0
    assert tiny_draft.cache.used_blocks == 0
