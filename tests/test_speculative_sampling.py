"""Speculative sampling has exactly the target's output distribution -- through the
production path.

A small-vocabulary bundle built for the test: bigram "decoders" exported as real ONNX
graphs (logits = table[last token]; a KV past that just records the tokens), with a
``manifest.json`` naming one the target and the other the draft model. The real
``Engine`` serves it: requests are admitted and batched by the round coordinator, the
draft model proposes through the proposer worker (sampling its own distribution q from
the drafter's generator), and the target worker verifies with ``speculative/rounds.verify``.
Because the target is a bigram table, the exact distribution of the first tokens is
known in closed form, so a chi-square goodness-of-fit test can compare the engine's
samples (one request per seed) against it. The same test fails for a deliberately
broken acceptance rule, which proves it can fail.
"""
from __future__ import annotations

import itertools
import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from tokenizers import Tokenizer, models

import specserve.engine.speculative.rounds as rounds
from specserve.engine import Engine, EngineConfig, GenerationOptions, SchedulerConfig, SpeculativeConfig
from specserve.engine.grammar.spec import StructuredOutput
from specserve.engine.model.manifest import BundleManifest
from specserve.engine.speculative.sampling import sample, token_distribution
from specserve.engine.speculative.verify import Verdict

VOCAB = 4
NEW_TOKENS = 4
DRAWS = 12_000
PROMPT = [0, 1]


def build_bigram_model(directory: Path, table: np.ndarray, busy_work: int = 0) -> Path:
    """An ONNX decoder with the optimum interface whose logits depend only on the last token.

    ``busy_work`` > 0 adds a [n, n] @ [n, n] product per call that feeds the logits with
    weight 0: the logits are unchanged, but the call costs what a real target's weights
    cost -- far more than its draft -- so adaptive speculation has a reason to draft."""
    directory.mkdir(parents=True)
    initializers = [numpy_helper.from_array(np.log(table).astype(np.float32), "table"),
                    numpy_helper.from_array(np.array([1, 3]), "axes13")]
    logits = "logits" if not busy_work else "bigram_logits"
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], [logits], axis=0),
        helper.make_node("Cast", ["input_ids"], ["ids_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["ids_f", "axes13"], ["new_kv"]),
        helper.make_node("Concat", ["past_key_values.0.key", "new_kv"], ["present.0.key"], axis=2),
        helper.make_node("Concat", ["past_key_values.0.value", "new_kv"], ["present.0.value"], axis=2),
    ]
    if busy_work:
        initializers += [numpy_helper.from_array(np.full((busy_work, busy_work), 0.01, np.float32), "busy"),
                         numpy_helper.from_array(np.zeros((1,), np.float32), "zero")]
        nodes += [  # busy @ (busy * mean(ids)): depends on the input, so it is never folded away
            helper.make_node("ReduceMean", ["ids_f"], ["ids_mean"], keepdims=0),
            helper.make_node("Mul", ["busy", "ids_mean"], ["scaled"]),
            helper.make_node("MatMul", ["busy", "scaled"], ["product"]),
            helper.make_node("ReduceSum", ["product"], ["busy_sum"], keepdims=0),
            helper.make_node("Mul", ["busy_sum", "zero"], ["nothing"]),
            helper.make_node("Add", ["bigram_logits", "nothing"], ["logits"]),
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
        initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save(model, str(directory / "model.onnx"))
    Tokenizer(models.WordLevel({c: i for i, c in enumerate("abcd")}, unk_token="a")).save(str(directory / "tokenizer.json"))
    (directory / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "max_position_embeddings": 64}))
    return directory


def bundle_manifest(entries: dict[str, Path]) -> BundleManifest:
    """The least a valid manifest needs; the numbers describe the bigram models, and no
    loader reads the records of training and corpus."""
    training = dict(seed=0, steps=0, batch_size=1, seq_len=1, learning_rate=0.0, objective="none", tokens_seen=0,
                    seconds=0.0)
    architecture = dict(vocab_size=VOCAB, hidden_size=1, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1,
                        intermediate_size=1, max_position_embeddings=64, rope_theta=1.0, rms_norm_eps=1e-6)
    return BundleManifest.model_validate(dict(
        tokenizer="tokenizer.json", eos_token="a", eos_token_id=0,
        corpus=dict(source="bigram tables", python_version="-", root="-", selection="-", heldout_rule="-",
                    train_files={}, heldout_files={}, train_tokens=0, heldout_tokens=0,
                    unigram_cross_entropy_nats=math.log(VOCAB)),
        models={role: dict(role=role, directory=path.name, onnx="model.onnx", weights="none", config="config.json",
                           tokenizer="tokenizer.json", parameters=VOCAB * VOCAB, architecture=architecture,
                           hidden_outputs=dict(final="logits"), heldout_loss_nats=0.0, training=training)
                for role, path in entries.items()},
        arrays={}))


def make_bigram_bundle(root: Path, busy_work: int = 0) -> tuple[Path, np.ndarray]:
    """(the bundle directory, the target's bigram table)."""
    rng = np.random.default_rng(7)
    target_table = rng.dirichlet(np.ones(VOCAB) * 0.8, size=VOCAB)
    draft_table = 0.5 * target_table + 0.5 * rng.dirichlet(np.ones(VOCAB), size=VOCAB)  # q != p, overlapping
    entries = {"target": build_bigram_model(root / "target", target_table, busy_work),
               "draft": build_bigram_model(root / "draft", draft_table)}
    bundle_manifest(entries).save(root)
    return root, target_table


@pytest.fixture(scope="module")
def bigram_bundle(tmp_path_factory):
    return make_bigram_bundle(tmp_path_factory.mktemp("bigram"))


@pytest.fixture(scope="module")
def bigram_engine(bigram_bundle):
    """The real engine on the bigram bundle; a batch holds 64 concurrent requests, each
    drafting 3 tokens every round (adaptive speculation off: here the target costs no more
    than its draft, so adapting would rightly stop drafting)."""
    root, _ = bigram_bundle
    engine = Engine(root, EngineConfig(device="cpu", intra_op_threads=1, speculative=SpeculativeConfig(adaptive=False),
                                       scheduler=SchedulerConfig(max_batch_size=64)))
    assert engine.available_modes == ["none", "prompt_lookup", "suffix", "draft_model"] and engine.draft is not None
    yield engine
    engine.close()


# A grammar over the bigram vocabulary ("abcd"; "a", token 0, is EOS): position i may hold
# only the letters of ALLOWED[i], so the constrained distribution is the target's bigram
# renormalised over them, position by position -- known in closed form too.
ALLOWED = ("bc", "bcd", "bd", "cd")
GRAMMAR = StructuredOutput.regex("".join(f"[{letters}]" for letters in ALLOWED))


def exact_distribution(table: np.ndarray, allowed: tuple[str, ...] | None = None) -> dict[tuple, float]:
    """Each sequence's probability: under ``allowed``, each position's bigram row masked to
    its letters and renormalised (the target's logits masked by the grammar)."""
    out = {}
    for seq in itertools.product(range(VOCAB), repeat=NEW_TOKENS):
        p, last = 1.0, PROMPT[-1]
        for i, token in enumerate(seq):
            row = table[last]
            if allowed is not None:
                mask = np.array([c in allowed[i] for c in "abcd"])
                row = np.where(mask, row, 0.0) / row[mask].sum()
            p, last = p * row[token], token
        out[seq] = p
    return out


def draw(engine: Engine, mode: str, n: int, first_seed: int, concurrency: int = 64,
         adaptive: bool | None = None, grammar: StructuredOutput | None = None, seeded: bool = True) -> list[tuple]:
    """``n`` independent samples: one request per seed, submitted concurrently so the
    coordinator batches them (as a server under load would). Without a grammar EOS is
    ignored; a grammar never allows it before its end. ``seeded`` False: no seed (fresh
    entropy each), as a request that drafts from other requests' outputs needs."""
    def one(seed: int) -> tuple:
        options = GenerationOptions(max_new_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=grammar is None,
                                    seed=seed if seeded else None, speculative_mode=mode, num_speculative_tokens=3,
                                    adaptive_speculation=adaptive, structured_output=grammar)
        return tuple(engine.generate(PROMPT, options).token_ids)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        samples = list(pool.map(one, range(first_seed, first_seed + n)))
    assert engine.drain()
    assert engine.target.cache.used_blocks == 0 and engine.draft.cache.used_blocks == 0
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


def test_speculative_sampling_matches_the_target_distribution(bigram_engine, bigram_bundle):
    _, table = bigram_bundle
    before = bigram_engine.cumulative_stats.get("draft_model")
    samples = draw(bigram_engine, "draft_model", DRAWS, first_seed=1)
    stats = bigram_engine.cumulative_stats["draft_model"]
    assert before is None and stats.proposed_tokens > DRAWS  # the draft model really proposed ...
    assert 0.2 < stats.acceptance_rate < 0.95                # ... and was neither always right nor always wrong
    assert chi_square_p_value(samples, exact_distribution(table)) > 0.01


def test_suffix_sampling_drafting_from_other_requests_matches_the_target_distribution(bigram_engine, bigram_bundle):
    """Unseeded, so every request drafts from the outputs of the samples before it (the
    suffix cache) as well as its own: drafts that depend on other requests' random draws
    still leave each sample distributed as the target's."""
    _, table = bigram_bundle
    bigram_engine.reset_suffix_cache()
    draws = DRAWS // 2  # the draft model's tests above cover the rule at full power; this is its suffix use
    samples = draw(bigram_engine, "suffix", draws, first_seed=1, seeded=False)
    stats = bigram_engine.cumulative_stats["suffix"]
    assert stats.proposed_tokens > draws and 0.2 < stats.acceptance_rate < 0.95
    assert bigram_engine.reset_suffix_cache() > 0  # the samples' outputs were there to draft from
    assert chi_square_p_value(samples, exact_distribution(table)) > 0.01


def test_target_only_sampling_matches_too(bigram_engine, bigram_bundle):
    _, table = bigram_bundle
    assert chi_square_p_value(draw(bigram_engine, "none", 4000, first_seed=1), exact_distribution(table)) > 0.01


def broken_verify(logits, drafts, draft_probs, context, options, rng, rules, grammar=None):
    """Wrong on purpose: on rejection, resample from p instead of norm(max(0, p - q))
    (masked by the grammar as the real rule is, so only the rejection rule differs)."""
    prefix = list(context)
    for i, d in enumerate(drafts):
        p = token_distribution(logits[i], prefix, options, rules, grammar.allowed() if grammar else None)
        q = draft_probs[i]
        if rng.random() * q[d] >= p[d]:
            token = sample(p, rng)
            if grammar:
                grammar.advance(token)
            return Verdict(i, token)
        if grammar:
            grammar.advance(d)
        prefix.append(d)
    token = sample(token_distribution(logits[-1], prefix, options, rules, grammar.allowed() if grammar else None), rng)
    if grammar:
        grammar.advance(token)
    return Verdict(len(drafts), token)


def test_a_broken_acceptance_rule_fails_the_same_test(bigram_engine, bigram_bundle, monkeypatch):
    """The target worker verifies with ``rounds.verify``: break it, and the engine's
    samples must fail the very check the real rule passes (same seeds)."""
    _, table = bigram_bundle
    monkeypatch.setattr(rounds, "verify", broken_verify)
    assert chi_square_p_value(draw(bigram_engine, "draft_model", DRAWS, first_seed=1),
                              exact_distribution(table)) < 0.01


def test_speculative_sampling_under_a_grammar_matches_the_masked_target_distribution(bigram_engine, bigram_bundle):
    """With a grammar on, the output's distribution is the target's masked by the grammar
    at each position -- with the draft model drafting under the same grammar (its q masked
    too) and its drafts rejected or accepted by the real rule."""
    _, table = bigram_bundle
    stats = bigram_engine.cumulative_stats.get("draft_model")
    before = stats.proposed_tokens if stats else 0
    samples = draw(bigram_engine, "draft_model", DRAWS, first_seed=1, grammar=GRAMMAR)
    assert all(len(s) == NEW_TOKENS and all("abcd"[t] in ALLOWED[i] for i, t in enumerate(s)) for s in samples)
    assert bigram_engine.cumulative_stats["draft_model"].proposed_tokens > before + DRAWS  # it drafted
    assert chi_square_p_value(samples, exact_distribution(table, ALLOWED)) > 0.01


def test_a_broken_acceptance_rule_fails_under_the_grammar_too(bigram_engine, bigram_bundle, monkeypatch):
    """Half the draws are plenty to catch it."""
    _, table = bigram_bundle
    monkeypatch.setattr(rounds, "verify", broken_verify)
    assert chi_square_p_value(draw(bigram_engine, "draft_model", DRAWS // 2, first_seed=1, grammar=GRAMMAR),
                              exact_distribution(table, ALLOWED)) < 0.01


def test_adaptive_speculation_keeps_the_target_distribution(tmp_path):
    """Adaptive speculation changes how many drafts each round verifies, never how: the
    samples still fit the target's exact distribution. The target here costs what a real
    one does relative to its draft (``busy_work``), so the controller does draft -- and,
    learning acceptance and costs as it goes, not always the maximum."""
    root, table = make_bigram_bundle(tmp_path / "bigram", busy_work=384)
    with Engine(root, EngineConfig(device="cpu", intra_op_threads=1)) as engine:
        samples = draw(engine, "draft_model", DRAWS // 2, first_seed=1, concurrency=2, adaptive=True)
        stats = engine.cumulative_stats["draft_model"]
    assert stats.proposed_tokens > DRAWS // 4  # it drafted ...
    assert stats.proposed_tokens < 3 * stats.verification_steps  # ... choosing fewer than 3 drafts in some rounds
    assert chi_square_p_value(samples, exact_distribution(table)) > 0.01
