"""The default model's two formats (``engine.model.graph_family``).

The fast format computes with int8 activations, where a bit of difference between two
computations of one position moves logits by whole units: it is lossless only because
its graphs compute every row alike whatever the call holds. So the proof is bitwise, at
the graph (a position by one-token steps, inside verifies of every width, in a batch of
32 beside other sequences) and through the engine (every mode at 1 and 32 streams, and a
tie built at a real position, which any difference between two computations of it would
break), served too. The exact format, the option, passes the same engine checks."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from specserve.engine import Engine, GenerationOptions
from specserve.engine.errors import ModelLoadError
from specserve.engine.model.default_model import DEFAULT_MODEL_DIR
from specserve.engine.model.cached_decoder import CachedDecoder
from specserve.engine.model.graph_family import FAST_FILE, FAST_IN_PLACE_FILE
from specserve.engine.model.in_place import InPlaceDecoder
from specserve.engine.model.onnx_model import OnnxDecoder
from specserve.engine.model.tokenizer import TextTokenizer
from specserve.engine.speculative.proposers.registry import PROPOSER_MODES

from .conftest import CPU_CONFIG, TARGET_DIR, generate_concurrently

ROOT = Path(__file__).resolve().parents[1]
TARGET = DEFAULT_MODEL_DIR / "target"
NEW_TOKENS = 24
STREAMS = 32


@pytest.fixture(scope="module")
def texts() -> list[list[int]]:
    """Real text as token ids, one per held-out prompt (the graphs see language, not noise)."""
    tokenizer = TextTokenizer(TARGET)
    prompts = [p["prompt"] for p in json.loads((ROOT / "tests/data/heldout_prompts.json").read_text())]
    return [tokenizer.encode(p) for p in prompts]


@pytest.fixture(scope="module")
def fast_graph() -> InPlaceDecoder:
    standard = OnnxDecoder(TARGET, "cpu", 2, onnx_file=FAST_FILE)
    return InPlaceDecoder(standard, TARGET / FAST_IN_PLACE_FILE, 2, thread_spinning=True, batched=True)


def _stepped(graph: InPlaceDecoder, ids: list[int], prefill: int, capacity: int | None = None
             ) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """Logits of positions ``[prefill, len(ids))``, one token a call after one prefill;
    and the past as it stood after the prefill (keys, values per layer)."""
    buffer = graph.new_buffer(capacity or len(ids))
    graph.run(buffer, 0, np.array([ids[:prefill]]))
    past = [k.copy() for k in buffer.keys], [v.copy() for v in buffer.values]
    logits = [graph.run(buffer, i, np.array([[ids[i]]]))[0][0] for i in range(prefill, len(ids))]
    return np.concatenate(logits), *past


def test_a_position_is_the_same_bits_in_a_step_and_in_verifies_of_every_width(fast_graph, texts):
    """~1200 positions: the one-token step's logits against the same positions inside
    calls of 2, 5, 9 and 17 tokens (a verify of 1, 4, 8 and 16 drafts)."""
    ids = sum(texts, [])[:400]
    prefill = 100
    steps = _stepped(fast_graph, ids, prefill)[0]
    for width in (2, 5, 9, 17):
        buffer = fast_graph.new_buffer(len(ids))
        fast_graph.run(buffer, 0, np.array([ids[:prefill]]))
        rows = [fast_graph.run(buffer, start, np.array([ids[start : start + width]]))[0][0]
                for start in range(prefill, len(ids), width)]
        assert np.array_equal(np.concatenate(rows), steps), width


def test_a_sequence_is_the_same_bits_in_a_batch_of_32_whatever_its_neighbours(fast_graph, texts):
    """32 sequences of different lengths, each verifying 5 tokens in one batched call,
    twice with the rows in other orders: every row equals that sequence's own steps."""
    rng = np.random.default_rng(0)
    sequences = [(texts[i % len(texts)] * 3)[i : i + 24 + 5 * i] for i in range(STREAMS)]
    pasts = [len(s) - 5 for s in sequences]
    capacity = max(len(s) for s in sequences) + 3
    stepped = [_stepped(fast_graph, s, p, capacity) for s, p in zip(sequences, pasts)]
    for _ in range(2):
        order = rng.permutation(STREAMS)
        keys = [np.concatenate([stepped[i][1][layer] for i in order]) for layer in range(len(stepped[0][1]))]
        values = [np.concatenate([stepped[i][2][layer] for i in order]) for layer in range(len(stepped[0][2]))]
        binding, _kept = fast_graph.bind_rows(keys, values)
        logits, _ = fast_graph.run_rows(binding, np.array([pasts[i] for i in order]),
                                        np.array([sequences[i][pasts[i]:] for i in order]))
        for row, i in enumerate(order):
            assert np.array_equal(logits[row], stepped[i][0]), i


def test_a_prefill_asking_for_its_last_logits_computes_that_row_alone_and_the_same(fast_graph, texts):
    """The graph cuts the LM head's rows to the ones asked for (a prefill's last): the row it
    keeps is the same bits as in a call that computes every row, and so is every other output."""
    ids = np.array([texts[0][:60]])
    every, every_extras = fast_graph.run(fast_graph.new_buffer(64), 0, ids)
    last, last_extras = fast_graph.run(fast_graph.new_buffer(64), 0, ids, logits_from=59)
    assert fast_graph.cuts_logits and every.shape[1] == 60 and last.shape[1] == 1
    assert np.array_equal(last[0, 0], every[0, -1])
    assert all(np.array_equal(last_extras[name], every_extras[name]) for name in every_extras)


def test_prompt_logprobs_still_see_every_prompt_row(default_engine, texts):
    """A prefill asked for prompt logprobs feeds every row through the LM head: each prompt
    token's logprob is the log-softmax of the row before it, as a full call gives it."""
    prompt = texts[1][:30]
    result = default_engine.generate(prompt, GenerationOptions(max_new_tokens=2, prompt_logprobs=0))
    buffer = default_engine.target.in_place.new_buffer(32)
    logits = default_engine.target.in_place.run(buffer, 0, np.array([prompt]))[0][0].astype(np.float64)
    expected = logits - logits.max(-1, keepdims=True)
    expected -= np.log(np.exp(expected).sum(-1, keepdims=True))
    got = [p.logprob for p in result.prompt_logprobs]
    assert len(got) == len(prompt) - 1
    np.testing.assert_allclose(got, [expected[i, prompt[i + 1]] for i in range(len(prompt) - 1)], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def fast_engine(default_engine):
    return default_engine  # the default model's default format


@pytest.fixture(scope="module")
def exact_engine():
    with Engine(config=CPU_CONFIG.model_copy(update={"target_format": "exact"})) as engine:
        yield engine


def test_the_default_engine_serves_the_fast_format_and_the_exact_one_is_an_option(default_engine, exact_engine):
    assert default_engine.target.family.name == "fast"
    assert default_engine.target.in_place.batched and default_engine.target.row_buffers is not None
    assert exact_engine.target.family.name == "exact" and exact_engine.target.row_buffers is None


def test_a_bundle_without_a_fast_format_serves_the_exact_one_by_default():
    with Engine(TARGET_DIR.parent, CPU_CONFIG) as engine:
        assert engine.target.family.name == "exact"


def _concurrent_modes(engine: Engine, chats: list[list[dict]], extra: dict | None = None) -> tuple[list, list]:
    """Target-only's tokens for each chat one at a time, and every mode's for them with
    32 requests in flight at once (modes mixed in the batch)."""
    template = engine.chat_template
    prompts = [engine.tokenizer.encode(template.render(c)) for c in chats]
    base = GenerationOptions(max_new_tokens=NEW_TOKENS, temperature=0, **(extra or {}))
    solo = [engine.generate(p, base.model_copy(update={"speculative_mode": "none"})).token_ids for p in prompts]
    modes = engine.available_modes
    jobs = [(prompts[i % len(prompts)], base.model_copy(update={"speculative_mode": modes[i % len(modes)]}))
            for i in range(STREAMS)]
    results = generate_concurrently(engine, jobs)
    return [solo[i % len(prompts)] for i in range(STREAMS)], [getattr(r, "token_ids", r) for r in results]


@pytest.fixture(scope="module")
def chats() -> list[list[dict]]:
    return [p["messages"] for p in json.loads((ROOT / "tests/data/heldout_chat_prompts.json").read_text())]


def test_every_mode_at_32_streams_is_target_only_one_at_a_time(fast_engine, chats):
    expected, got = _concurrent_modes(fast_engine, chats[:8])
    assert got == expected
    assert fast_engine.target.row_buffers.reused + fast_engine.target.row_buffers.rebuilt > 0  # batches ran in rows


@pytest.fixture(scope="module")
def near_tie(fast_engine, chats) -> dict:
    """A logit bias that leaves target-only's greedy token at one position of a real
    reply ahead of the runner-up by the least a float32 logit can be: any computation of
    that position that differs in a bit from target-only's would likely pick the other."""
    options = GenerationOptions(max_new_tokens=NEW_TOKENS, temperature=0, logprobs=True, top_logprobs=2,
                                speculative_mode="none")
    result = fast_engine.chat(chats[0], options)
    # The position where the runner-up is closest: a real near tie in the model already.
    position = min(range(5, len(result.logprobs)), key=lambda j: result.logprobs[j].top[0].logprob
                   - result.logprobs[j].top[1].logprob)
    first, second = result.logprobs[position].top[:2]
    margin = np.float32(first.logprob) - np.float32(second.logprob)
    return {"chat": chats[0], "bias": ((second.token_id, float(margin)),), "position": position,
            "tokens": (first.token_id, second.token_id)}


def test_a_constructed_near_tie_is_decided_as_target_only_decides_it_in_every_mode(fast_engine, near_tie, chats):
    """The runner-up's bias brings it to within float32 rounding of the greedy token at
    one position; every mode, at 1 and 32 streams, commits what target-only does there
    (whichever that is) and after it."""
    extra = {"logit_bias": near_tie["bias"]}
    expected, got = _concurrent_modes(fast_engine, [near_tie["chat"], *chats[1:4]], extra)
    assert got == expected
    reply = expected[0]
    assert reply[near_tie["position"]] in near_tie["tokens"]
    for mode in PROPOSER_MODES:
        options = GenerationOptions(max_new_tokens=NEW_TOKENS, temperature=0, speculative_mode=mode,
                                    adaptive_speculation=False, **extra)
        assert fast_engine.chat(near_tie["chat"], options).token_ids == reply, mode


def test_the_exact_format_every_mode_at_32_streams_is_target_only(exact_engine, chats):
    expected, got = _concurrent_modes(exact_engine, chats[:8])
    assert got == expected


def test_a_cpu_that_computes_rows_differently_falls_back_to_the_exact_format(monkeypatch, caplog):
    """A fake, for a fault this machine cannot show: MLAS picks kernels by CPU, and on a
    CPU whose kernels made a row depend on its call the load-time check must catch it."""
    monkeypatch.setattr(InPlaceDecoder, "row_invariance", lambda self: 0.25)
    with caplog.at_level(logging.WARNING, logger="specserve.engine"):
        target = CachedDecoder(TARGET, CPU_CONFIG, graph_format="fast")
    assert target.family.name == "exact" and target.row_buffers is None
    assert target.decoder.onnx_path.name == "model.onnx" and target.in_place.path.name == "model.inplace.onnx"
    assert "serving the exact format instead" in caplog.text
    target.cache.add_sequence(0)
    assert np.isfinite(target.feed(0, [1, 2, 3], 0).logits).all()


def test_asking_a_bundle_without_a_fast_format_for_it_is_a_clear_load_error():
    with pytest.raises(ModelLoadError, match="no fast format"):
        Engine(TARGET_DIR.parent, CPU_CONFIG.model_copy(update={"target_format": "fast"}))
