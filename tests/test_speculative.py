"""Speculative decoding is lossless: every proposer reproduces target-only greedy output
token for token, on held-out prompts, while really getting drafts accepted."""
from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from engine import GenerationOptions, InvalidRequestError
from engine.model.manifest import BundleManifest

from .conftest import MODELS

MODES = ["prompt_lookup", "draft_model", "mtp", "eagle3", "shared_kv"]


@pytest.fixture(scope="module")
def reference(bundle_engine, heldout_prompts):
    """Target-only greedy output for 20 held-out prompts x 64 tokens (EOS ignored)."""
    options = GenerationOptions(max_new_tokens=64, ignore_eos=True, speculative_mode="none")
    return [bundle_engine.generate(p, options) for p in heldout_prompts[:20]]


@pytest.mark.parametrize("mode", MODES)
def test_greedy_output_is_identical_to_target_only(mode, bundle_engine, heldout_prompts, reference):
    options = GenerationOptions(max_new_tokens=64, ignore_eos=True, speculative_mode=mode, num_speculative_tokens=4)
    accepted = proposed = rounds = 0
    for prompt, expected in zip(heldout_prompts[:20], reference):
        result = bundle_engine.generate(prompt, options)
        assert result.token_ids == expected.token_ids, f"{mode} diverged on {prompt[-60:]!r}"
        assert result.text == expected.text and result.finish_reason == expected.finish_reason
        stats = result.speculative
        assert stats.mode == mode and stats.committed_tokens == 63  # the first token comes from the prefill
        accepted, proposed, rounds = accepted + stats.accepted_tokens, proposed + stats.proposed_tokens, \
            rounds + stats.verification_steps
    # Equality would hold trivially for a proposer that never proposes: prove it drafts well.
    assert proposed > 0 and accepted > 0
    assert rounds < 20 * 63 * (0.95 if mode == "prompt_lookup" else 0.8), f"{mode}: {rounds} rounds, no speedup"
    assert bundle_engine.target.cache.used_blocks == 0
    if bundle_engine.draft is not None:
        assert bundle_engine.draft.cache.used_blocks == 0


@pytest.mark.parametrize("mode", ["draft_model", "mtp"])
def test_stops_logprobs_and_penalties_match_target_only(mode, bundle_engine, heldout_prompts):
    base = dict(max_new_tokens=40, logprobs=True, top_logprobs=2, repetition_penalty=1.3, stop=["\n\n", "return"])
    for prompt in heldout_prompts[20:24]:
        plain = bundle_engine.generate(prompt, GenerationOptions(**base, speculative_mode="none"))
        fast = bundle_engine.generate(prompt, GenerationOptions(**base, speculative_mode=mode))
        assert (fast.token_ids, fast.text, fast.finish_reason) == (plain.token_ids, plain.text, plain.finish_reason)
        np.testing.assert_allclose([lp.logprob for lp in fast.logprobs], [lp.logprob for lp in plain.logprobs],
                                   atol=1e-3)
        assert [[t.token_id for t in lp.top] for lp in fast.logprobs] == \
            [[t.token_id for t in lp.top] for lp in plain.logprobs]


def test_streaming_is_identical_under_speculation(bundle_engine, heldout_prompts):
    events = {}
    for mode in ("none", "eagle3"):
        seen = []
        bundle_engine.generate(heldout_prompts[7], GenerationOptions(max_new_tokens=30, speculative_mode=mode),
                               on_token=seen.append)
        events[mode] = [(e.token_id, e.text, e.finish_reason) for e in seen]
    assert events["eagle3"] == events["none"]


def test_per_request_mode_and_width_override_the_default(bundle_engine, heldout_prompts):
    one = bundle_engine.generate(heldout_prompts[0], GenerationOptions(
        max_new_tokens=32, speculative_mode="draft_model", num_speculative_tokens=1))
    assert len(one.speculative.proposed_per_position) == 1
    wide = bundle_engine.generate(heldout_prompts[0], GenerationOptions(
        max_new_tokens=32, speculative_mode="draft_model", num_speculative_tokens=6))
    assert len(wide.speculative.proposed_per_position) == 6
    plain = bundle_engine.generate(heldout_prompts[0], GenerationOptions(max_new_tokens=32))
    assert plain.speculative.mode == "none" and plain.speculative.proposed_tokens == 0
    assert plain.speculative.verification_steps == plain.completion_tokens - 1


def test_unloaded_mode_and_bad_width_are_clear_errors(target_engine):
    with pytest.raises(InvalidRequestError, match="'mtp' is not loaded"):
        target_engine.generate("x = 1", GenerationOptions(speculative_mode="mtp"))
    with pytest.raises(ValidationError, match="num_speculative_tokens"):
        GenerationOptions(num_speculative_tokens=0)
    with pytest.raises(ValidationError, match="speculative_mode"):
        GenerationOptions(speculative_mode="medusa")


def test_stats_count_rounds_acceptance_per_position_and_tau(bundle_engine, heldout_prompts):
    result = bundle_engine.generate(heldout_prompts[2], GenerationOptions(
        max_new_tokens=48, ignore_eos=True, speculative_mode="eagle3", num_speculative_tokens=3))
    s = result.speculative
    assert s.committed_tokens == 47 and s.verification_steps > 0
    assert s.mean_accepted_length == pytest.approx(47 / s.verification_steps)
    assert s.accepted_tokens == sum(s.accepted_per_position) and s.proposed_tokens == sum(s.proposed_per_position)
    assert s.acceptance_per_position == [a / p for a, p in zip(s.accepted_per_position, s.proposed_per_position)]
    assert all(0 <= rate <= 1 for rate in s.acceptance_per_position)
    # Acceptance can only fall with depth: position i+1 is reached only through position i.
    assert all(x >= y for x, y in zip(s.accepted_per_position, s.accepted_per_position[1:]))
    before = bundle_engine.cumulative_stats["eagle3"].verification_steps
    bundle_engine.generate(heldout_prompts[3], GenerationOptions(max_new_tokens=8, speculative_mode="eagle3"))
    assert bundle_engine.cumulative_stats["eagle3"].verification_steps > before


def test_bundled_heads_really_predict_the_target():
    manifest = BundleManifest.load(MODELS)
    assert set(manifest.heads) == {"mtp", "eagle3", "shared_kv"}
    for kind, head in manifest.heads.items():
        assert head.heldout_top1_agreement[0] > 0.3, f"{kind}: {head.heldout_top1_agreement}"
