"""Request options validation and the logits -> token rules."""
from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from engine import EngineConfig, GenerationOptions
from engine.spec.sampling import apply_repetition_penalty, sample, token_distribution


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
