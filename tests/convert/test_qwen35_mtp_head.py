"""A published-layout Qwen3.5 MTP head converts to the engine's MTP graph and computes
what the published head computes (transformers' Qwen3.5 layer as the reference).

Runs in the convert venv (mobius-onnx, torch, transformers); specserve's own .venv does
not collect tests/convert (tests/conftest.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import onnx
import onnxruntime as ort

from modelbuild.convert.qwen35_mtp import CONTRACT_INPUTS, CONTRACT_OUTPUTS, build_qwen35_mtp
from tests.convert.tiny_qwen35_mtp import qwen35_mtp_reference, write_tiny_qwen35_mtp

HIDDEN, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 64, 4096, 4, 2, 16
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, Path, dict]:
    """(checkpoint dir, head dir, facts): the tiny checkpoint, converted once for the module."""
    root = tmp_path_factory.mktemp("qwen35_mtp")
    checkpoint = write_tiny_qwen35_mtp(root / "checkpoint", hidden_size=HIDDEN, vocab_size=VOCAB, num_heads=HEADS,
                                       num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, seed=0)
    facts = build_qwen35_mtp(checkpoint, root / "head")
    return checkpoint, root / "head", facts


@pytest.fixture(scope="module")
def session(converted):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(str(converted[1] / "model.onnx"), options, providers=["CPUExecutionProvider"])


def _run(session, embeds, hidden, positions, past_key=None, past_value=None):
    batch, seq, _ = embeds.shape
    if past_key is None:
        past_key = past_value = np.zeros((batch, KV_HEADS, 0, HEAD_DIM), np.float32)
    feeds = {"inputs_embeds": embeds, "hidden_states": hidden,
             "attention_mask": np.ones((batch, past_key.shape[2] + seq), np.int64),
             "position_ids": positions.astype(np.int64),
             "past_key_values.0.key": past_key, "past_key_values.0.value": past_value}
    return session.run(list(CONTRACT_OUTPUTS), feeds)


def _random(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_one_pass_matches_the_reference(converted, session):
    checkpoint = converted[0]
    rng = np.random.default_rng(1)
    embeds, hidden = _random(rng, 2, 3, HIDDEN), _random(rng, 2, 3, HIDDEN)
    positions = np.array([[0, 1, 2], [7, 8, 9]], np.int64)  # each row its own offset
    mtp_hidden, present_key, present_value = _run(session, embeds, hidden, positions)
    expected = qwen35_mtp_reference(checkpoint, embeds, hidden, positions)
    assert mtp_hidden.shape == expected.shape == (2, 3, HIDDEN)
    assert np.abs(mtp_hidden - expected).max() < TOLERANCE
    assert present_key.shape == present_value.shape == (2, KV_HEADS, 3, HEAD_DIM)


def test_two_steps_through_the_cache_match_the_reference_over_both(converted, session):
    """Step 1 reads step 0's cache and, as the engine's proposer does, threads the head's
    own last ``mtp_hidden`` as its hidden state; the reference sees both steps' inputs
    at once, causally, with no cache."""
    checkpoint = converted[0]
    rng = np.random.default_rng(2)
    embeds0, hidden0 = _random(rng, 1, 3, HIDDEN), _random(rng, 1, 3, HIDDEN)
    out0, key0, value0 = _run(session, embeds0, hidden0, np.arange(3)[None])
    embeds1, hidden1 = _random(rng, 1, 1, HIDDEN), out0[:, -1:]
    out1, key1, value1 = _run(session, embeds1, hidden1, np.array([[3]]), key0, value0)
    assert key1.shape == value1.shape == (1, KV_HEADS, 4, HEAD_DIM)
    np.testing.assert_array_equal(key1[:, :, :3], key0)  # the cache is appended to, not rewritten
    expected = qwen35_mtp_reference(checkpoint, np.concatenate([embeds0, embeds1], 1),
                                    np.concatenate([hidden0, hidden1], 1), np.arange(4)[None])
    assert np.abs(out0 - expected[:, :3]).max() < TOLERANCE
    assert np.abs(out1[:, -1] - expected[:, -1]).max() < TOLERANCE


def test_graph_io_is_the_engine_contract(converted):
    _, head_dir, facts = converted
    model = onnx.load(str(head_dir / "model.onnx"), load_external_data=False)
    graph = model.graph
    assert tuple(i.name for i in graph.input) == CONTRACT_INPUTS == (
        "inputs_embeds", "hidden_states", "attention_mask", "position_ids",
        "past_key_values.0.key", "past_key_values.0.value")
    assert tuple(o.name for o in graph.output) == CONTRACT_OUTPUTS == ("mtp_hidden", "present.0.key", "present.0.value")

    def described(value):
        tensor = value.type.tensor_type
        return tensor.elem_type, [d.dim_value or None for d in tensor.shape.dim]

    float32, int64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
    shapes = {value.name: described(value) for value in (*graph.input, *graph.output)}
    for name in ("inputs_embeds", "hidden_states", "mtp_hidden"):
        assert shapes[name] == (float32, [None, None, HIDDEN])
    for name in ("attention_mask", "position_ids"):
        assert shapes[name] == (int64, [None, None])
    for name in ("past_key_values.0.key", "past_key_values.0.value", "present.0.key", "present.0.value"):
        assert shapes[name] == (float32, [None, KV_HEADS, None, HEAD_DIM])

    # The main model's tensors beside mtp.* (embed_tokens, lm_head: vocab x hidden) stay out.
    assert all(VOCAB not in init.dims for init in graph.initializer)
    assert facts["source_format"] == "qwen3.5-mtp"
    assert {k: facts[k] for k in ("hidden_size", "num_key_value_heads", "head_dim", "vocab_size")} == {
        "hidden_size": HIDDEN, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB}
    assert facts["external_data"] is None or (head_dir / facts["external_data"]).is_file()


@pytest.mark.parametrize("change, error", [
    ("strip_mtp", ValueError),          # a quantized re-upload without the head
    ("moe_experts", NotImplementedError),  # a Qwen3.5-MoE / Qwen3-Next style MTP layer
    ("fp8", NotImplementedError),  # an FP8 release: block-scaled weights are not dequantized
])
def test_heads_mobius_cannot_build_are_refused(tmp_path, change, error):
    import torch
    from safetensors.torch import load_file, save_file

    checkpoint = write_tiny_qwen35_mtp(tmp_path / "checkpoint", hidden_size=HIDDEN, vocab_size=256, num_heads=HEADS,
                                       num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    tensors = load_file(str(checkpoint / "model.safetensors"))
    if change == "strip_mtp":
        tensors = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    elif change == "moe_experts":
        tensors["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = torch.zeros(8, HIDDEN, dtype=torch.bfloat16)
    else:
        tensors["mtp.fc.weight"] = tensors["mtp.fc.weight"].to(torch.float8_e4m3fn)
        tensors["mtp.fc.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, str(checkpoint / "model.safetensors"))
    with pytest.raises(error):
        build_qwen35_mtp(checkpoint, tmp_path / "head")
    assert not (tmp_path / "head" / "model.onnx").exists()
