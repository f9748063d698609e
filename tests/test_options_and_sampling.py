"""Request options validation and the logits -> token rules."""
from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from specserve.engine import EngineConfig, GenerationOptions
from specserve.engine.speculative.sampling import (SequenceRules, apply_repetition_penalty, processed_logits, sample,
                                         token_distribution)


@pytest.mark.parametrize("fields, named", [
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_k": -3}, "top_k"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"top_logprobs": 99}, "top_logprobs"),
    ({"stop": [""]}, "stop"),
    ({"max_tokens": 5}, "max_tokens"),  # unknown field: a typo must not pass silently
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logit_bias": {3: 101}}, "logit_bias"),
    ({"logit_bias": {-1: 5}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_new_tokens": 8}, "min_tokens"),
])
def test_invalid_options_name_the_field(fields, named):
    with pytest.raises(ValidationError) as info:
        GenerationOptions(**fields)
    assert named in str(info.value)


def test_engine_config_rejects_unknown_fields():
    with pytest.raises(ValidationError, match="kv_blocks"):
        EngineConfig(kv_blocks=3)


def test_stop_accepts_a_single_string():
    assert GenerationOptions(stop="\n\n").stop == ("\n\n",)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = np.array([2.0, -2.0, 1.0, 3.0], dtype=np.float32)
    out = apply_repetition_penalty(logits, [0, 1, 1], 2.0)
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0, 3.0])
    np.testing.assert_array_equal(logits, [2.0, -2.0, 1.0, 3.0])  # input untouched


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    k2 = token_distribution(logits, [], GenerationOptions(temperature=1.0, top_k=2))
    np.testing.assert_allclose(k2, [0.625, 0.375, 0, 0])
    p = token_distribution(logits, [], GenerationOptions(temperature=1.0, top_p=0.8))
    np.testing.assert_allclose(p, [0.625, 0.375, 0, 0])  # 0.5 + 0.3 reaches 0.8
    p = token_distribution(logits, [], GenerationOptions(temperature=1.0, top_p=0.81))
    np.testing.assert_allclose(p, np.array([0.5, 0.3, 0.15, 0]) / 0.95)
    greedy = token_distribution(logits, [], GenerationOptions())
    np.testing.assert_array_equal(greedy, [1, 0, 0, 0])


def test_temperature_sharpens_and_flattens():
    logits = np.log(np.array([0.6, 0.4]))
    cold = token_distribution(logits, [], GenerationOptions(temperature=0.5))
    hot = token_distribution(logits, [], GenerationOptions(temperature=2.0))
    assert cold[0] > 0.6 > hot[0] > 0.5


def test_sampling_follows_the_distribution():
    probs = np.array([0.1, 0.0, 0.6, 0.3])
    rng = np.random.default_rng(0)
    counts = np.bincount([sample(probs, rng) for _ in range(20_000)], minlength=4) / 20_000
    np.testing.assert_allclose(counts, probs, atol=0.015)
    assert counts[1] == 0


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    """vLLM's rule: a token's logit loses presence_penalty once it was generated, and
    frequency_penalty per time; the prompt's tokens (0 and 1 here) are not counted."""
    logits = np.zeros(5, np.float32)
    context = [0, 1, 1, 2, 2, 2, 3]  # prompt [0, 1, 1], then generated 2, 2, 2, 3
    options = GenerationOptions(presence_penalty=0.5, frequency_penalty=0.25)
    out = processed_logits(logits, context, options, SequenceRules(prompt_length=3))
    np.testing.assert_allclose(out, [0, 0, -(0.5 + 3 * 0.25), -(0.5 + 0.25), 0])
    assert out.dtype == np.float32
    # Without rules (a drafter that does not know the sequence) nothing counts as generated.
    np.testing.assert_array_equal(processed_logits(logits, context, options), logits)


def test_logit_bias_is_added_before_the_repetition_penalty():
    logits = np.array([1.0, 2.0, -1.0, 0.5], np.float32)
    options = GenerationOptions(logit_bias={0: 3.0, 2: -100.0}, repetition_penalty=2.0)
    out = processed_logits(logits, [0], options, SequenceRules(prompt_length=1))
    np.testing.assert_allclose(out, [(1.0 + 3.0) / 2.0, 2.0, -101.0, 0.5])  # biased, then penalised as seen
    np.testing.assert_array_equal(logits, [1.0, 2.0, -1.0, 0.5])  # input untouched
    assert int(np.argmax(processed_logits(logits, [], GenerationOptions(logit_bias={3: 5.0})))) == 3
    assert token_distribution(logits, [], GenerationOptions(temperature=1.0, logit_bias={1: -100.0}))[1] < 1e-40


def test_min_tokens_masks_the_ending_tokens_until_enough_are_generated():
    logits = np.array([5.0, 1.0, 4.0, 0.0], np.float32)  # token 0 is EOS, token 2 a stop token id
    options = GenerationOptions(min_tokens=2, stop_token_ids=[2], temperature=1.0)
    rules = SequenceRules.of(prompt_length=3, options=options, eos_token_ids=[0])
    assert rules.end_tokens == {0, 2}
    for generated, masked in ((0, True), (1, True), (2, False)):
        context = [7, 7, 7] + [1] * generated
        probs = token_distribution(logits, context, options, rules)
        assert bool(probs[0] == probs[2] == 0.0) is masked and probs.sum() == pytest.approx(1.0)
    # ignore_eos: EOS never ends the sequence, so it is not masked either
    ignoring = SequenceRules.of(3, options.model_copy(update={"ignore_eos": True}), [0])
    assert ignoring.end_tokens == {2}
