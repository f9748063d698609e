"""Calls at batch 1 on a model's in-place graph (``engine.model.in_place``) give what the
standard graph gives, through rewinds, batched calls in between and buffer growth, and
an in-place graph that does not match its standard graph is never used."""
from __future__ import annotations

import json
import logging
import os
import random
import shutil

import numpy as np
import pytest

from specserve.engine import Engine, GenerationOptions
from specserve.engine.model.cached_decoder import CachedDecoder, FeedRequest
from specserve.engine.model.in_place import CAPACITY_STEP, IN_PLACE_FILE, buffer_capacity
from specserve.modelbuild.fused_graph import build_fused_decoder
from tests.conftest import CPU_CONFIG, DRAFT_DIR, MODELS, TARGET_DIR

STANDARD = CPU_CONFIG.model_copy(update={"in_place_kv": False})


def test_buffer_capacity_leaves_room_in_whole_steps_within_the_context():
    assert buffer_capacity(30, 512) == 2 * CAPACITY_STEP      # 30 + 64, rounded up to a step
    assert buffer_capacity(400, 512) == 512                   # never past the context...
    assert buffer_capacity(600, 512) == 600                   # ...unless the call itself needs more
    assert all(buffer_capacity(n, 512) >= n for n in range(1, 600))


@pytest.mark.parametrize("model_dir", [TARGET_DIR, DRAFT_DIR], ids=["target", "draft"])
def test_in_place_calls_match_the_standard_graph_through_rewinds_batches_and_growth(model_dir):
    """Sequence "a" decodes alone on the in-place graph, with a second sequence "b" joining it twice
    for a batched call (and a batch-1 call of each while both are there, which the
    standard graph serves: two spinning thread pools must not alternate)."""
    in_place, standard = CachedDecoder(model_dir, CPU_CONFIG), CachedDecoder(model_dir, STANDARD)
    assert in_place.in_place is not None and standard.in_place is None
    calls_at_load = in_place.in_place.calls  # the load-time check's own runs
    rng = random.Random(3)
    vocab = standard.decoder.vocab_size

    def both(requests: list[FeedRequest]) -> None:
        outs = [decoder.feed_batch(requests) for decoder in (in_place, standard)]
        for got, want in zip(*outs):
            np.testing.assert_allclose(got.logits, want.logits, atol=1e-4)
            assert (got.logits.argmax(-1) == want.logits.argmax(-1)).all()
            for name in want.extras:
                np.testing.assert_allclose(got.extras[name], want.extras[name], atol=1e-4)

    def add(seq: str, length: int) -> None:
        for decoder in (in_place, standard):
            decoder.cache.add_sequence(seq)
        both([FeedRequest(seq, [rng.randrange(vocab) for _ in range(length)], 0)])

    add("a", 30)
    length = 30
    previous, after_batch, grew, on_in_place = in_place.cache.kept_session("a").buffer, False, 0, 1
    for round_ in range(100):  # "a" outgrows its buffer (128 slots after its prefill) and the next
        drafts = [rng.randrange(vocab) for _ in range(5)]
        both([FeedRequest("a", drafts, length)])
        on_in_place += 1
        buffer = in_place.cache.kept_session("a").buffer
        if buffer is not previous:  # a new buffer only after a batched call's row, or to grow
            assert after_batch or length + 5 > previous.capacity
            grew += not after_batch
        previous, after_batch = buffer, False
        length += 1 + round_ % 4  # the rest rejected: a rewind, i.e. a shorter length
        for decoder in (in_place, standard):
            decoder.cache.rewind("a", length)
        if round_ in (7, 22):  # "b" joins for a batched call; "a"'s next buffer starts from its row
            calls = in_place.in_place.calls
            add("b", 12)
            both([FeedRequest("a", [rng.randrange(vocab)], length), FeedRequest("b", [1, 2], 12)])
            both([FeedRequest("b", [3], 14)])
            assert in_place.in_place.calls == calls  # not alone: the standard graph, every call
            for seq in ("a", "b"):  # what the pools and a shared-KV head read
                for (k1, v1), (k2, v2) in zip(in_place.cache.materialize(seq), standard.cache.materialize(seq)):
                    np.testing.assert_allclose(k1, k2, atol=1e-4)
                    np.testing.assert_allclose(v1, v2, atol=1e-4)
            for decoder in (in_place, standard):
                decoder.cache.free("b")
            length += 1
            after_batch = True
    assert grew >= 1 and length > 256
    layer = len(standard.decoder.layers) // 2
    for (k1, v1), (k2, v2) in zip(in_place.cache.materialize("a"), standard.cache.materialize("a")):
        np.testing.assert_allclose(k1, k2, atol=1e-4)
        np.testing.assert_allclose(v1, v2, atol=1e-4)
    for got, want in zip(in_place.cache.slice("a", layer), standard.cache.slice("a", layer)):
        np.testing.assert_allclose(got, want, atol=1e-4)
    assert in_place.in_place.calls - calls_at_load == on_in_place == 101  # "a"'s prefill and every round alone
    # The prefill, the 2 rounds after a batched call, the growths; every other round in place.
    assert in_place.buffers_made == 1 + 2 + grew


def test_a_slice_of_an_in_place_sequence_is_a_read_only_view_the_later_rounds_leave_alone():
    """What a shared-KV head reads of a sequence on the in-place graph is a view of its buffer, not
    a copy (the head copies it into its padded batch anyway): read only, and the rounds
    after it -- drafts written past its end and rewound -- never change it."""
    decoder = CachedDecoder(TARGET_DIR, CPU_CONFIG)
    rng = random.Random(5)
    vocab, layer, length = decoder.decoder.vocab_size, 3, 20
    decoder.cache.add_sequence("a")
    decoder.feed_batch([FeedRequest("a", [rng.randrange(vocab) for _ in range(length)], 0)])
    key, value = decoder.cache.slice("a", layer)
    assert np.shares_memory(key, decoder.cache.kept_session("a").buffer.keys[layer])
    assert not key.flags.writeable and not value.flags.writeable
    taken = key.copy(), value.copy()
    for _ in range(6):
        decoder.feed_batch([FeedRequest("a", [rng.randrange(vocab) for _ in range(5)], length)])
        length += 2
        decoder.cache.rewind("a", length)
    np.testing.assert_array_equal(key, taken[0])
    np.testing.assert_array_equal(value, taken[1])
    assert decoder.cache.slice("a", layer)[0].shape[2] == length


@pytest.mark.parametrize("mode", ["none", "eagle3", "draft_model"])
def test_engine_output_is_the_same_with_and_without_the_in_place_graph(mode, heldout_prompts):
    options = GenerationOptions(max_new_tokens=40, ignore_eos=True, speculative_mode=mode, logprobs=True)
    results = {}
    for name, config in (("in place", CPU_CONFIG), ("standard", STANDARD)):
        engine = Engine(MODELS, config)
        try:
            results[name] = [engine.generate(p, options) for p in heldout_prompts[:3]]
            if name == "in place":
                assert engine.target.in_place.calls > 0
        finally:
            engine.close()
    for got, want in zip(results["in place"], results["standard"]):
        assert got.token_ids == want.token_ids
        np.testing.assert_allclose([lp.logprob for lp in got.logprobs], [lp.logprob for lp in want.logprobs],
                                   atol=1e-3)


def _copy_model(tmp_path):
    for name in ("config.json", "model.safetensors", "model.onnx", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DRAFT_DIR / name, tmp_path / name)
    return tmp_path


def test_a_model_without_an_in_place_graph_runs_the_standard_graph(tmp_path):
    decoder = CachedDecoder(_copy_model(tmp_path), CPU_CONFIG)
    assert decoder.in_place is None
    decoder.cache.add_sequence(0)
    assert decoder.feed(0, [1, 2, 3], 0).logits.shape[0] == 3


def test_an_in_place_graph_that_disagrees_with_its_graph_is_not_used(tmp_path, caplog):
    """A stale in-place graph (here: built with another rotary base) must not serve: the standard
    graph does, and the log says why."""
    model = _copy_model(tmp_path)
    config = json.loads((model / "config.json").read_text())
    wrong = dict(config, rope_theta=config.get("rope_theta", 10000.0) * 3)
    (model / "config.json").write_text(json.dumps(wrong))
    build_fused_decoder(model, model / IN_PLACE_FILE, in_place=True)
    (model / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="specserve.engine"):
        decoder = CachedDecoder(model, CPU_CONFIG)
    assert decoder.in_place is None
    assert "logits differ" in caplog.text


def test_a_sliding_window_or_the_switch_keeps_the_standard_graph():
    assert CachedDecoder(DRAFT_DIR, CPU_CONFIG.model_copy(update={"sliding_window": 64})).in_place is None
    assert CachedDecoder(DRAFT_DIR, STANDARD).in_place is None


@pytest.mark.parametrize("change", [{"intra_op_threads": 1}, {"thread_spinning": False}],
                         ids=["one thread", "no spinning"])
def test_without_a_spinning_pool_the_in_place_graph_serves_batch_1_calls_among_other_sequences(change):
    """No pool spinning after its runs, nothing to fight over: a one-thread decoder (the
    draft model's, by default) or one that does not spin (a Serve replica's) runs every
    batch-1 call in place, however many sequences it holds; a spinning one does not."""
    for config, expected in ((CPU_CONFIG.model_copy(update=change), 2), (CPU_CONFIG, 1)):
        decoder = CachedDecoder(DRAFT_DIR, config)
        for seq in (0, 1):
            decoder.cache.add_sequence(seq)
            decoder.feed(seq, [1, 2, 3], 0)
        assert decoder.in_place.calls - 2 == expected  # 2: the load-time check's runs
        assert decoder.buffers_made == expected


def _pool(session) -> tuple[int, str | None, str | None]:
    """(intra-op threads, allow_spinning, force_spinning_stop) a session was made with."""
    options = session.get_session_options()

    def entry(key: str) -> str | None:
        try:
            return options.get_session_config_entry(key)
        except RuntimeError:  # onnxruntime raises for a key never set
            return None

    return (options.intra_op_num_threads, entry("session.intra_op.allow_spinning"),
            entry("session.force_spinning_stop"))


def test_in_place_threads_give_the_in_place_graph_its_own_pool_spinning_only_within_a_run():
    """A Serve replica's worker: one sleeping thread for batched calls (its reservation),
    ``in_place_threads`` for its batch-1 calls, spinning within a run (threads that sleep
    between ops wake for every one), never after it."""
    worker = CPU_CONFIG.model_copy(update={"intra_op_threads": 1, "thread_spinning": False, "in_place_threads": 2})
    decoder = CachedDecoder(DRAFT_DIR, worker)
    assert _pool(decoder.in_place.session) == (2, None, "1")
    assert _pool(decoder.decoder.session) == (1, "0", None)
    # Unset, the in-place graph takes the target's own threads and spinning.
    asleep = CachedDecoder(DRAFT_DIR, worker.model_copy(update={"in_place_threads": None, "intra_op_threads": 2}))
    assert _pool(asleep.in_place.session) == (2, "0", None)


def test_a_workers_batch_1_calls_get_two_threads_unless_configured():
    from specserve.deployments.workers import LONE_SEQUENCE_THREADS, worker_config

    assert worker_config({"intra_op_threads": 1}).in_place_threads == max(1, min(LONE_SEQUENCE_THREADS,
                                                                               os.cpu_count() or 1))
    assert worker_config({"intra_op_threads": 4}).in_place_threads == 4  # never fewer than the reservation's
    assert worker_config({"intra_op_threads": 1, "in_place_threads": 1}).in_place_threads == 1
    # Batched calls spin while they run and sleep between them (the router needs the cores then).
    assert worker_config({"intra_op_threads": 2}).spinning(owns_cores=False) == "within_run"
    assert worker_config({"intra_op_threads": 2, "thread_spinning": False}).spinning(owns_cores=False) == "never"


def test_an_in_place_graph_onnxruntime_cannot_load_is_not_used(tmp_path, caplog):
    model = _copy_model(tmp_path)
    (model / IN_PLACE_FILE).write_bytes(b"not an onnx graph")
    with caplog.at_level(logging.WARNING, logger="specserve.engine"):
        decoder = CachedDecoder(model, CPU_CONFIG)
    assert decoder.in_place is None
    assert "cannot load" in caplog.text
