"""Speculative sampling has exactly the target's output distribution.

A small-vocabulary model built for the test: bigram "decoders" exported as real ONNX
graphs (logits = table[last token]; a KV past that just records the tokens), run by real
onnxruntime through the real cache and round loop, with the draft model sampling its
own distribution q. Because the target is a bigram table, the exact distribution of the
first tokens is known in closed form, so a chi-square goodness-of-fit test can compare
speculative samples against it. The same test fails for a deliberately broken
acceptance rule, which proves it can fail.
"""
from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from tokenizers import Tokenizer, models

import engine.spec.rounds as rounds
from engine import GenerationOptions
from engine.model.cached_decoder import CachedDecoder
from engine.options import EngineConfig
from engine.spec.proposers.draft_model import DraftModelProposer
from engine.spec.sequence import SequenceState
from engine.spec.stats import SpeculativeStats
from engine.spec.verify import Verdict
from engine.spec.sampling import sample, token_distribution

VOCAB = 4
NEW_TOKENS = 4
DRAWS = 12_000
PROMPT = [0, 1]


def build_bigram_model(directory: Path, table: np.ndarray) -> Path:
    """An ONNX decoder with the optimum interface whose logits depend only on the last token."""
    directory.mkdir(parents=True)
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["logits"], axis=0),
        helper.make_node("Cast", ["input_ids"], ["ids_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["ids_f", "axes13"], ["new_kv"]),
        helper.make_node("Concat", ["past_key_values.0.key", "new_kv"], ["present.0.key"], axis=2),
        helper.make_node("Concat", ["past_key_values.0.value", "new_kv"], ["present.0.value"], axis=2),
    ]
    kv = lambda name, length: helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", 1, length, 1])
    graph = helper.make_graph(
        nodes, "bigram",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"]),
         helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "sequence"]),
         kv("past_key_values.0.key", "past"), kv("past_key_values.0.value", "past")],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", VOCAB]),
         kv("present.0.key", "total"), kv("present.0.value", "total")],
        [numpy_helper.from_array(np.log(table).astype(np.float32), "table"),
         numpy_helper.from_array(np.array([1, 3]), "axes13")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save(model, str(directory / "model.onnx"))
    Tokenizer(models.WordLevel({c: i for i, c in enumerate("abcd")}, unk_token="a")).save(str(directory / "tokenizer.json"))
    (directory / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "max_position_embeddings": 64}))
    return directory


@pytest.fixture(scope="module")
def bigram_pair(tmp_path_factory):
    rng = np.random.default_rng(7)
    target_table = rng.dirichlet(np.ones(VOCAB) * 0.8, size=VOCAB)
    draft_table = 0.5 * target_table + 0.5 * rng.dirichlet(np.ones(VOCAB), size=VOCAB)  # q != p, overlapping
    root = tmp_path_factory.mktemp("bigram")
    config = EngineConfig(device="cpu", intra_op_threads=1)
    target = CachedDecoder(build_bigram_model(root / "target", target_table), config)
    draft = CachedDecoder(build_bigram_model(root / "draft", draft_table), config)
    return target, draft, target_table


def exact_distribution(table: np.ndarray) -> dict[tuple, float]:
    out = {}
    for seq in itertools.product(range(VOCAB), repeat=NEW_TOKENS):
        p, last = 1.0, PROMPT[-1]
        for token in seq:
            p, last = p * table[last, token], token
        out[seq] = p
    return out


def draw(target: CachedDecoder, draft: CachedDecoder | None, n: int, seed: int) -> list[tuple]:
    options = GenerationOptions(max_new_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True)
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        state = SequenceState(PROMPT, options, target.tokenizer, (), target.max_context)
        proposer = DraftModelProposer(draft) if draft is not None else None
        target.cache.add_sequence(i)
        try:
            rounds.decode(target, i, state, proposer, 3, rng, SpeculativeStats())
        finally:
            target.cache.free(i)
            if proposer is not None:
                proposer.close()
        samples.append(tuple(state.generated))
    return samples


def chi_square_p_value(samples: list[tuple], expected: dict[tuple, float]) -> float:
    """Goodness of fit; cells expected < 5 are pooled. p from the Wilson-Hilferty
    normal approximation of the chi-square tail (accurate for these degrees of freedom)."""
    n = len(samples)
    counts: dict[tuple, int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for seq, p in expected.items():
        e, o = n * p, counts.get(seq, 0)
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
            continue
        stat, cells = stat + (o - e) ** 2 / e, cells + 1
    if pooled_exp > 0:
        stat, cells = stat + (pooled_obs - pooled_exp) ** 2 / pooled_exp, cells + 1
    df = cells - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_speculative_sampling_matches_the_target_distribution(bigram_pair):
    target, draft, table = bigram_pair
    samples = draw(target, draft, DRAWS, seed=1)
    assert chi_square_p_value(samples, exact_distribution(table)) > 0.01
    assert target.cache.used_blocks == 0 and draft.cache.used_blocks == 0


def test_target_only_sampling_matches_too(bigram_pair):
    target, _, table = bigram_pair
    assert chi_square_p_value(draw(target, None, 4000, seed=2), exact_distribution(table)) > 0.01


def broken_verify(logits, drafts, draft_probs, context, options, rng):
    """Wrong on purpose: on rejection, resample from p instead of norm(max(0, p - q))."""
    prefix = list(context)
    for i, d in enumerate(drafts):
        p = token_distribution(logits[i], prefix, options)
        q = draft_probs[i]
        if rng.random() * q[d] >= p[d]:
            return Verdict(i, sample(p, rng))
        prefix.append(d)
    return Verdict(len(drafts), sample(token_distribution(logits[-1], prefix, options), rng))


def test_a_broken_acceptance_rule_fails_the_same_test(bigram_pair, monkeypatch):
    target, draft, table = bigram_pair
    monkeypatch.setattr(rounds, "verify", broken_verify)
    assert chi_square_p_value(draw(target, draft, DRAWS, seed=1), exact_distribution(table)) < 0.01
