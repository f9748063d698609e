"""A Gemma-4 assistant checkpoint, converted by mobius, against transformers' own
``Gemma4AssistantForCausalLM``: same logits and projected state, a right-padded batch
row equal to its unpadded run, the shared-KV graph contract, and the group -> target
layer binding transformers uses. Needs the convert venv (torch, transformers, mobius)."""
from __future__ import annotations

import numpy as np
import pytest

import onnxruntime as ort

from specserve.modelbuild.convert.gemma4_assistant import GROUPS, bind_groups, build_gemma4_assistant
from tests.convert.tiny_gemma4_assistant import (
    gemma4_assistant_reference,
    write_tiny_gemma4_assistant,
)

TOLERANCE = 1e-4
SLIDING_WINDOW = 4  # the tiny checkpoint's: a KV longer than 5 slots is cut on sliding layers


class Built:
    def __init__(self, root, **options):
        self.checkpoint = write_tiny_gemma4_assistant(root / "hf", sliding_window=SLIDING_WINDOW, **options)
        self.facts = build_gemma4_assistant(self.checkpoint, root / "onnx")
        self.path = root / "onnx" / "model.onnx"
        so = ort.SessionOptions()
        so.intra_op_num_threads = 2
        self.session = ort.InferenceSession(str(self.path), so, providers=["CPUExecutionProvider"])

    def run(self, feed):
        return self.session.run(["logits", "projected_state"], feed)

    def reference(self, feed):
        shared = {g: (feed[f"shared_kv.{g}.key"], feed[f"shared_kv.{g}.value"]) for g in GROUPS}
        return gemma4_assistant_reference(self.checkpoint, feed["inputs_embeds"], feed["position_ids"], shared,
                                          feed["attention_mask"])

    def inputs(self, batch, q_len, kv_len, seed=0):
        rng = np.random.default_rng(seed)
        feed = {"inputs_embeds": rng.standard_normal((batch, q_len, 2 * self.facts["backbone_hidden_size"]),
                                                     dtype=np.float32),
                "position_ids": np.full((batch, q_len), kv_len - 1, np.int64),
                "attention_mask": np.ones((batch, kv_len), np.int64)}
        for group, shape in self.facts["groups"].items():
            for part in ("key", "value"):
                feed[f"shared_kv.{group}.{part}"] = rng.standard_normal(
                    (batch, shape["num_kv_heads"], kv_len, shape["head_dim"]), dtype=np.float32)
        return feed


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return Built(tmp_path_factory.mktemp("gemma4_assistant"))


@pytest.fixture(scope="module")
def ordered(tmp_path_factory):
    return Built(tmp_path_factory.mktemp("gemma4_assistant_ordered"), ordered_embeddings=True, seed=1)


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    """E2B's shape of geometry: full layers with their own head size; an untied LM head."""
    return Built(tmp_path_factory.mktemp("gemma4_assistant_uneven"), global_head_dim=32,
                 tie_word_embeddings=False, seed=2)


def _max_diff(got, want):
    return max(float(np.abs(g - w).max()) for g, w in zip(got, want))


def test_single_row_matches_transformers(plain):
    feed = plain.inputs(batch=1, q_len=1, kv_len=7)
    got, want = plain.run(feed), plain.reference(feed)
    assert got[0].shape == (1, 1, 4096) and got[1].shape == (1, 1, 64)
    assert _max_diff(got, want) < TOLERANCE


def test_right_padded_row_equals_its_unpadded_run(plain):
    """Row 1 holds 6 real slots and 3 of padding (garbage, not zeros, so a leak shows);
    6 > window + 1, so its sliding layers must count the window from its last real slot."""
    kv_len, real = 9, 6
    feed = plain.inputs(batch=2, q_len=1, kv_len=kv_len, seed=3)
    feed["attention_mask"][1, real:] = 0
    feed["position_ids"][1] = real - 1
    got = plain.run(feed)

    row0 = {name: value[:1] for name, value in feed.items()}
    assert _max_diff([g[:1] for g in got], plain.reference(row0)) < TOLERANCE

    row1 = {name: value[1:2] for name, value in feed.items()}
    row1["attention_mask"] = row1["attention_mask"][:, :real]
    for group in GROUPS:
        for part in ("key", "value"):
            row1[f"shared_kv.{group}.{part}"] = row1[f"shared_kv.{group}.{part}"][:, :, :real]
    alone = plain.run(row1)
    assert _max_diff([g[1:2] for g in got], alone) < TOLERANCE
    assert _max_diff(alone, plain.reference(row1)) < TOLERANCE


def test_graph_io_is_the_shared_kv_contract(plain, uneven):
    for built in (plain, uneven):
        facts = built.facts
        assert set(facts) == {"backbone_hidden_size", "hidden_size", "vocab_size", "groups", "source_format",
                              "ordered_embeddings"}
        assert (facts["backbone_hidden_size"], facts["hidden_size"], facts["vocab_size"]) == (64, 32, 4096)
        assert facts["source_format"] == "gemma4-assistant" and facts["ordered_embeddings"] is False
        inputs = {i.name: i for i in built.session.get_inputs()}
        want = {"inputs_embeds": ("tensor(float)", ["batch", "q_len", 128]),
                "position_ids": ("tensor(int64)", ["batch", "q_len"]),
                "attention_mask": ("tensor(int64)", ["batch", "kv_len"])}
        for group, shape in facts["groups"].items():
            for part in ("key", "value"):
                want[f"shared_kv.{group}.{part}"] = ("tensor(float)",
                                                     ["batch", shape["num_kv_heads"], "kv_len", shape["head_dim"]])
        assert {name: (i.type, i.shape) for name, i in inputs.items()} == want
        outputs = built.session.get_outputs()
        assert [(o.name, o.type, o.shape) for o in outputs] == [
            ("logits", "tensor(float)", ["batch", "q_len", 4096]),
            ("projected_state", "tensor(float)", ["batch", "q_len", 64])]
    assert plain.facts["groups"] == {"full_attention": {"num_kv_heads": 2, "head_dim": 16},
                                     "sliding_attention": {"num_kv_heads": 2, "head_dim": 16}}
    assert uneven.facts["groups"] == {"full_attention": {"num_kv_heads": 2, "head_dim": 32},
                                      "sliding_attention": {"num_kv_heads": 2, "head_dim": 16}}


def test_uneven_head_sizes_and_untied_head_match_transformers(uneven):
    feed = uneven.inputs(batch=1, q_len=1, kv_len=7, seed=4)
    assert _max_diff(uneven.run(feed), uneven.reference(feed)) < TOLERANCE


def test_centroid_masked_head_matches_transformers(ordered):
    assert ordered.facts["ordered_embeddings"] is True
    feed = ordered.inputs(batch=1, q_len=1, kv_len=7, seed=5)
    got, want = ordered.run(feed), ordered.reference(feed)
    assert _max_diff(got, want) < TOLERANCE
    # Only top_k (8) centroids x 64 tokens each are scored; the rest hold the fill value.
    assert int((got[0] > got[0].min()).sum()) <= 8 * 64


def test_bind_groups_follows_transformers_kv_sharing():
    """Each group reads the last target layer of its type before the KV-shared tail:
    exactly the layers transformers' own Gemma-4 config marks "store"."""
    from transformers import Gemma4TextConfig

    types = (["sliding_attention"] * 4 + ["full_attention"]) * 7  # E2B-like target, 35 layers
    for shared in (0, 20):
        target = Gemma4TextConfig(num_hidden_layers=35, layer_types=list(types), num_kv_shared_layers=shared,
                                  hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  vocab_size=128, vocab_size_per_layer_input=128, hidden_size_per_layer_input=0)
        stores = {types[i]: i for i, mode in enumerate(target.kv_sharing_modes) if mode == "store"}
        assert bind_groups(types, 35, list(GROUPS), num_kv_shared_layers=shared) == stores
    assert bind_groups(types, 35, list(GROUPS)) == {"full_attention": 34, "sliding_attention": 33}
    assert bind_groups(types, 35, list(GROUPS), num_kv_shared_layers=20) == {"full_attention": 14,
                                                                             "sliding_attention": 13}


def test_bind_groups_fallback_for_a_target_without_layer_types():
    assert bind_groups(None, 8, list(GROUPS)) == {"full_attention": 7, "sliding_attention": 7}
    assert bind_groups(["full_attention"] * 8, 8, list(GROUPS)) == {"full_attention": 7, "sliding_attention": 7}
    with pytest.raises(ValueError):
        bind_groups(["full_attention"] * 7, 8, list(GROUPS))
