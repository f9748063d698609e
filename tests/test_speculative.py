"""Speculative decoding is lossless: every proposer reproduces target-only greedy output
token for token, on held-out prompts, while really getting drafts accepted."""
from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from specserve.engine import GenerationOptions, InvalidRequestError
from specserve.engine.speculative.proposers.base import NO_NEEDS
from specserve.engine.speculative.proposers.prompt_lookup import PromptLookupProposer
from specserve.engine.speculative.proposers.registry import PROPOSER_MODES
from specserve.engine.speculative.reference import speculative_decode
from specserve.engine.speculative.stats import SpeculativeStats

MODES = ["prompt_lookup", "suffix", "draft_model", "mtp", "eagle3", "shared_kv"]
HEAD_MODES = ["mtp", "eagle3", "shared_kv"]


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
    assert bundle_engine.drain()
    assert bundle_engine.target.cache.used_blocks == 0 and bundle_engine.draft.cache.used_blocks == 0


def reference_decode(engine, mode: str, prompt: str, options: GenerationOptions, k: int):
    """The one-page reference loop (``engine/speculative/reference.py``) on the engine's own
    target and a fresh proposer of the same kind: no scheduler, no workers, no batching."""
    if mode == "none":
        proposer = None
    elif mode == "prompt_lookup":
        proposer = PromptLookupProposer(3, k)
    elif mode == "suffix":  # its own history only: the caller resets the engine's suffix cache first
        proposer = PROPOSER_MODES["suffix"].local_proposer(engine.config.speculative, k)
    else:
        proposer = engine.proposers[mode].new_proposer()
    try:
        return speculative_decode(engine.target, engine.factory.encode(prompt), options, proposer, k,
                                  engine.needs.get(mode, NO_NEEDS))
    finally:
        if proposer is not None:
            proposer.close()


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
@pytest.mark.parametrize("mode", ["none", *MODES])
def test_the_engine_gives_the_reference_loops_tokens(mode, temperature, bundle_engine, heldout_prompts):
    """The scheduler (coordinator, target worker, proposer worker) is the reference loop
    split across workers: same tokens, same rounds, same acceptances. Sampled requests too:
    both seed the verifier with ``default_rng(seed)`` and a sampling drafter with
    ``default_rng([seed, 1])``, so a seeded request is reproducible across the two (and
    across the server, which runs the same scheduler)."""
    k = 4
    for n, prompt in enumerate(heldout_prompts[13:16]):
        options = GenerationOptions(max_new_tokens=32, temperature=temperature, seed=100 + n, ignore_eos=True,
                                    speculative_mode=mode, num_speculative_tokens=k)
        bundle_engine.reset_suffix_cache()  # the reference's suffix proposer has no earlier outputs
        engine_result = bundle_engine.generate(prompt, options)
        assert bundle_engine.drain()  # the reference borrows the engine's target pool: it must be idle
        state, stats = reference_decode(bundle_engine, mode, prompt, options, k)
        assert engine_result.token_ids == state.generated, f"{mode} T={temperature}: engine != reference"
        assert engine_result.text == state.text
        mine = engine_result.speculative
        assert (mine.verification_steps, mine.proposed_per_position, mine.accepted_per_position) == \
            (stats.verification_steps, stats.proposed_per_position, stats.accepted_per_position)
    assert bundle_engine.target.cache.used_blocks == 0


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
    default = bundle_engine.generate(heldout_prompts[0], GenerationOptions(max_new_tokens=32))
    # default_mode "auto": the best loaded head; default width: SpeculativeConfig's 4
    assert bundle_engine.default_mode == "eagle3" and default.speculative.mode == "eagle3"
    assert len(default.speculative.proposed_per_position) == 4
    plain = bundle_engine.generate(heldout_prompts[0], GenerationOptions(max_new_tokens=32, speculative_mode="none"))
    assert plain.speculative.mode == "none" and plain.speculative.proposed_tokens == 0
    assert plain.speculative.verification_steps == plain.completion_tokens - 1
    assert default.token_ids == plain.token_ids == one.token_ids == wide.token_ids


def test_unloaded_mode_and_bad_width_are_clear_errors(target_engine):
    with pytest.raises(InvalidRequestError, match="'mtp' is not loaded"):
        target_engine.generate("x = 1", GenerationOptions(speculative_mode="mtp"))
    with pytest.raises(ValidationError, match="num_speculative_tokens"):
        GenerationOptions(num_speculative_tokens=0)
    with pytest.raises(ValidationError, match="speculative_mode"):
        GenerationOptions(speculative_mode="medusa")


def test_stats_count_what_really_went_through_the_target(bundle_engine, heldout_prompts, monkeypatch):
    """The request's stats against an independent record: every verify item the target
    worker received and every outcome it returned for this request."""
    worker = bundle_engine.transport.target
    verifies, outcomes = [], []
    real_step = worker.step

    def recording_step(prefills=(), verifies_=(), releases=()):
        results = real_step(prefills, verifies_, releases)
        verifies.extend(len(item.drafts) for item in verifies_)
        outcomes.extend(r.outcome for r in results[len(prefills):])
        return results

    monkeypatch.setattr(worker, "step", recording_step)
    before = SpeculativeStats()
    before.merge(bundle_engine.cumulative_stats.get("eagle3", SpeculativeStats()))
    result = bundle_engine.generate(heldout_prompts[2], GenerationOptions(
        max_new_tokens=48, ignore_eos=True, speculative_mode="eagle3", num_speculative_tokens=3))
    s = result.speculative
    accepted = [o.accepted for o in outcomes]
    assert s.verification_steps == len(verifies) == len(outcomes) > 0
    assert s.proposed_per_position == [sum(d > i for d in verifies) for i in range(3)]
    assert s.accepted_per_position == [sum(a > i for a in accepted) for i in range(3)]
    assert s.accepted_tokens == sum(accepted) and s.proposed_tokens == sum(verifies)
    # The prefill commits the first token; every round commits exactly its outcome's tokens.
    assert result.token_ids[1:] == [t for o in outcomes for t in o.tokens] and s.committed_tokens == 47
    assert s.mean_accepted_length > 2.0  # eagle3 really saves target passes on held-out code
    # Acceptance can only fall with depth: position i+1 is reached only through position i.
    assert all(x >= y for x, y in zip(s.accepted_per_position, s.accepted_per_position[1:]))
    after = bundle_engine.cumulative_stats["eagle3"]
    assert after.verification_steps == before.verification_steps + s.verification_steps
    assert after.accepted_per_position[:3] == [b + a for b, a in zip(
        before.accepted_per_position + [0] * 3, s.accepted_per_position)]


@pytest.mark.parametrize("mode", HEAD_MODES)
def test_bundled_heads_really_predict_the_target(mode, bundle_engine, heldout_prompts):
    """Measured, not read from the manifest: over held-out prompts most first drafts are
    the target's own greedy token, and a round commits well over two tokens."""
    total = SpeculativeStats()
    for prompt in heldout_prompts[:8]:
        total.merge(bundle_engine.generate(prompt, GenerationOptions(
            max_new_tokens=32, ignore_eos=True, speculative_mode=mode, num_speculative_tokens=3)).speculative)
    assert total.acceptance_per_position[0] > 0.6, total.acceptance_per_position
    assert total.mean_accepted_length > 2.0


@pytest.mark.parametrize("mode", MODES)
def test_penalties_logit_bias_and_min_tokens_keep_speculation_lossless(mode, bundle_engine, heldout_prompts):
    """OpenAI's presence/frequency penalties and logit_bias, and vLLM's min_tokens, change
    what the target chooses at every position (the penalties count the drafts accepted
    before it); every proposer must still give target-only's tokens, and sampled, the
    reference loop's."""
    prompt = heldout_prompts[17]
    unbiased = bundle_engine.generate(prompt, GenerationOptions(max_new_tokens=40, speculative_mode="none"))
    banned, stopper = unbiased.token_ids[1], unbiased.token_ids[3]
    base = dict(max_new_tokens=40, presence_penalty=0.6, frequency_penalty=0.3, logit_bias={banned: -100.0},
                min_tokens=12, stop_token_ids=[stopper])
    plain = bundle_engine.generate(prompt, GenerationOptions(**base, speculative_mode="none"))
    fast = bundle_engine.generate(prompt, GenerationOptions(**base, speculative_mode=mode))
    assert (fast.token_ids, fast.text, fast.finish_reason) == (plain.token_ids, plain.text, plain.finish_reason)
    assert fast.speculative.proposed_tokens > 0  # it drafted under these rules
    assert banned not in plain.token_ids and plain.token_ids != unbiased.token_ids
    assert stopper not in plain.token_ids[:11] and len(plain.token_ids) >= 12  # min_tokens held the stop token back
    sampled = GenerationOptions(**base, temperature=0.8, seed=7, speculative_mode=mode, num_speculative_tokens=4)
    result = bundle_engine.generate(prompt, sampled)
    assert bundle_engine.drain()
    state, _ = reference_decode(bundle_engine, mode, prompt, sampled, 4)
    assert result.token_ids == state.generated and banned not in result.token_ids


def test_min_tokens_defers_stop_strings_as_vllm_does(bundle_engine, heldout_prompts):
    """Until more than min_tokens are generated no stop string is looked for; after, one
    counts only if it ends in the text after theirs (vLLM V1's rule)."""
    prompt = heldout_prompts[17]
    free = bundle_engine.generate(prompt, GenerationOptions(max_new_tokens=40, speculative_mode="none"))
    assert free.finish_reason == "length"  # no EOS in it: min_tokens' mask changes nothing below
    stop = free.text[len(bundle_engine.tokenizer.decode(free.token_ids[:2])):][:2]  # text of the 3rd token on
    assert stop.strip(), "the held-out prompt's output must have text early on"
    early = bundle_engine.generate(prompt, GenerationOptions(max_new_tokens=40, stop=[stop], speculative_mode="none"))
    held = bundle_engine.generate(prompt, GenerationOptions(max_new_tokens=40, stop=[stop], min_tokens=20,
                                                            speculative_mode="eagle3"))
    assert early.finish_reason == "stop" and len(early.token_ids) <= 4
    assert len(held.token_ids) >= 20 and held.token_ids[:20] == free.token_ids[:20]
    # The first match that may count ends past the first 20 tokens' text (so begins at most len(stop) - 1 before).
    start = max(0, len(bundle_engine.tokenizer.decode(free.token_ids[:20])) - (len(stop) - 1))
    at = free.text.find(stop, start)
    assert (held.text, held.finish_reason) == ((free.text[:at], "stop") if at >= 0 else (free.text, "length"))
