"""A published-layout Qwen3.5 MTP head, dense or mixture-of-experts (Qwen3.5-MoE,
Qwen3.6-MoE with packed experts, Qwen3-Next), converts to the engine's MTP graph and
computes what the published head computes (transformers' own layers as the reference).

Runs in the convert venv (mobius-onnx, torch, transformers); specserve's own .venv does
not collect tests/convert (tests/conftest.py)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import onnx
import onnxruntime as ort

from specserve.modelbuild.convert.qwen35_mtp import CONTRACT_INPUTS, CONTRACT_OUTPUTS, SOURCE_FORMATS, build_qwen35_mtp
from tests.convert.tiny_qwen35_mtp import (qwen3_next_mtp_reference, qwen35_moe_mtp_reference, qwen35_mtp_reference,
                                           write_tiny_qwen3_next_mtp, write_tiny_qwen35_moe_mtp,
                                           write_tiny_qwen35_mtp)

HIDDEN, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 64, 4096, 4, 2, 16
EXPERTS, TOP_K = 4, 2
TOLERANCE = 1e-4
GEOMETRY = dict(hidden_size=HIDDEN, vocab_size=VOCAB, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, Path, dict]:
    """(checkpoint dir, head dir, facts): the tiny checkpoint, converted once for the module."""
    root = tmp_path_factory.mktemp("qwen35_mtp")
    checkpoint = write_tiny_qwen35_mtp(root / "checkpoint", hidden_size=HIDDEN, vocab_size=VOCAB, num_heads=HEADS,
                                       num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, seed=0)
    facts = build_qwen35_mtp(checkpoint, root / "head")
    return checkpoint, root / "head", facts


def _session(head_dir: Path):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(str(head_dir / "model.onnx"), options, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def session(converted):
    return _session(converted[1])


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
    _check_two_steps(session, lambda *args: qwen35_mtp_reference(converted[0], *args), seed=2)


def _check_two_steps(session, reference, seed: int) -> None:
    """Three positions, then one more through their cache with the last ``mtp_hidden``
    threaded: equal to ``reference`` over all four positions at once."""
    rng = np.random.default_rng(seed)
    embeds0, hidden0 = _random(rng, 1, 3, HIDDEN), _random(rng, 1, 3, HIDDEN)
    out0, key0, value0 = _run(session, embeds0, hidden0, np.arange(3)[None])
    embeds1, hidden1 = _random(rng, 1, 1, HIDDEN), out0[:, -1:]
    out1, key1, value1 = _run(session, embeds1, hidden1, np.array([[3]]), key0, value0)
    assert key1.shape == value1.shape == (1, KV_HEADS, 4, HEAD_DIM)
    np.testing.assert_array_equal(key1[:, :, :3], key0)  # the cache is appended to, not rewritten
    expected = reference(np.concatenate([embeds0, embeds1], 1), np.concatenate([hidden0, hidden1], 1),
                         np.arange(4)[None])
    assert np.abs(out0 - expected[:, :3]).max() < TOLERANCE
    assert np.abs(out1[:, -1] - expected[:, -1]).max() < TOLERANCE


def _assert_contract_io(head_dir: Path):
    """The saved graph's I/O is the engine's MTP contract, names, order, types and shapes;
    no main-model tensor (embed_tokens, lm_head: vocab x hidden) made it in."""
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

    assert all(VOCAB not in init.dims for init in graph.initializer)
    return graph


def test_graph_io_is_the_engine_contract(converted):
    _, head_dir, facts = converted
    _assert_contract_io(head_dir)
    assert facts["source_format"] == "qwen3.5-mtp"
    assert {k: facts[k] for k in ("hidden_size", "num_key_value_heads", "head_dim", "vocab_size")} == {
        "hidden_size": HIDDEN, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB}
    assert facts["external_data"] is None or (head_dir / facts["external_data"]).is_file()


@pytest.mark.parametrize("change, error", [
    ("strip_mtp", ValueError),          # a quantized re-upload without the head
    ("moe_experts", ValueError),  # routed experts under a dense qwen3_5 config: a malformed checkpoint
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


# ----------------------------------------------------------------------------------------
# Mixture-of-experts heads
# ----------------------------------------------------------------------------------------

# name -> (writer, reference, writer options, source_format). Each family its own seed, so
# that no two share weights.
MOE_HEADS = {
    "qwen3-next": (write_tiny_qwen3_next_mtp, qwen3_next_mtp_reference, {"seed": 3}, "qwen3-next-mtp"),
    "qwen3.5-moe": (write_tiny_qwen35_moe_mtp, qwen35_moe_mtp_reference, {"seed": 4}, "qwen3.5-moe-mtp"),
    "qwen3.6-moe-packed": (write_tiny_qwen35_moe_mtp, qwen35_moe_mtp_reference,
                           {"seed": 5, "packed_experts": True}, "qwen3.5-moe-mtp"),
}


@pytest.fixture(scope="module", params=list(MOE_HEADS))
def moe_head(request, tmp_path_factory):
    """(name, checkpoint dir, head dir, facts, session): each MoE layout, converted once."""
    writer, _, options, _ = MOE_HEADS[request.param]
    root = tmp_path_factory.mktemp(request.param.replace(".", "_"))
    checkpoint = writer(root / "checkpoint", **GEOMETRY, num_experts=EXPERTS, num_experts_per_tok=TOP_K, **options)
    facts = build_qwen35_mtp(checkpoint, root / "head")
    return request.param, checkpoint, root / "head", facts, _session(root / "head")


def test_moe_head_one_pass_matches_the_reference(moe_head):
    name, checkpoint, _, _, session = moe_head
    rng = np.random.default_rng(11)
    embeds, hidden = _random(rng, 2, 3, HIDDEN), _random(rng, 2, 3, HIDDEN)
    positions = np.array([[0, 1, 2], [7, 8, 9]], np.int64)
    mtp_hidden, present_key, present_value = _run(session, embeds, hidden, positions)
    routing: list = []
    expected = MOE_HEADS[name][1](checkpoint, embeds, hidden, positions, routing=routing)
    assert mtp_hidden.shape == expected.shape == (2, 3, HIDDEN)
    assert np.abs(mtp_hidden - expected).max() < TOLERANCE
    assert present_key.shape == present_value.shape == (2, KV_HEADS, 3, HEAD_DIM)
    # The routing the reference took is not degenerate: the six tokens do not all pick the
    # same top-2 and every expert is picked at least once, so a mis-mapped expert or a
    # wrong router shows in mtp_hidden.
    (chosen,) = routing
    assert chosen.shape == (6, TOP_K)
    assert len({frozenset(row) for row in chosen.tolist()}) > 1
    assert set(chosen.ravel().tolist()) == set(range(EXPERTS))


def test_moe_head_two_steps_through_the_cache_match_the_reference_over_both(moe_head):
    name, checkpoint, _, _, session = moe_head
    _check_two_steps(session, lambda *args: MOE_HEADS[name][1](checkpoint, *args), seed=12)


def test_moe_head_graph_io_is_the_engine_contract(moe_head):
    name, _, head_dir, facts, _ = moe_head
    graph = _assert_contract_io(head_dir)
    # Every routed expert, the router and the gated shared expert are in the graph.
    names = {init.name for init in graph.initializer}
    wanted = [f"layers.0.mlp.experts.{e}.{proj}.weight" for e in range(EXPERTS)
              for proj in ("gate_proj", "up_proj", "down_proj")]
    wanted += ["layers.0.mlp.gate.weight", "layers.0.mlp.shared_expert_gate.weight",
               "layers.0.mlp.shared_expert.down_proj.weight"]
    assert all(any(n.startswith(w) for n in names) for w in wanted), sorted(names)
    assert facts["source_format"] == MOE_HEADS[name][3] == SOURCE_FORMATS[
        "qwen3_next" if name == "qwen3-next" else "qwen3_5_moe"]
    assert {k: facts[k] for k in ("hidden_size", "num_key_value_heads", "head_dim", "vocab_size", "num_experts",
                                  "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")} == {
        "hidden_size": HIDDEN, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB,
        "num_experts": EXPERTS, "num_experts_per_tok": TOP_K, "moe_intermediate_size": 32, "norm_topk_prob": True}


def test_a_qwen3_next_config_saved_by_transformers_5_builds_the_same_head(tmp_path):
    """transformers 5 re-saves the hub's flat rope_theta / partial_rotary_factor as
    rope_parameters; the head converted from either computes the same."""
    import shutil

    from transformers import AutoConfig

    hub = write_tiny_qwen3_next_mtp(tmp_path / "hub", **GEOMETRY, seed=6)
    resaved = tmp_path / "resaved"
    AutoConfig.from_pretrained(str(hub)).save_pretrained(str(resaved))
    assert "rope_theta" not in json.loads((resaved / "config.json").read_text())
    shutil.copy(hub / "model.safetensors", resaved / "model.safetensors")
    rng = np.random.default_rng(13)
    embeds, hidden, positions = _random(rng, 1, 2, HIDDEN), _random(rng, 1, 2, HIDDEN), np.array([[5, 6]])
    outputs = []
    for checkpoint in (hub, resaved):
        build_qwen35_mtp(checkpoint, checkpoint / "head")
        outputs.append(_run(_session(checkpoint / "head"), embeds, hidden, positions)[0])
    np.testing.assert_allclose(outputs[0], outputs[1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("change, error", [
    ("fp8_expert", NotImplementedError),     # an FP8 release (Qwen3-Next-80B-A3B-Instruct-FP8)
    ("dense_mlp", ValueError),               # a qwen3_next config over a dense MTP MLP
    ("extra_expert", ValueError),            # more experts than num_experts: no place in the graph
    ("missing_expert", ValueError),          # an expert the checkpoint lacks: a graph weight left unset
    ("half_packed", ValueError),             # packed gate_up_proj without its down_proj
    ("two_layers", NotImplementedError),     # a deeper MTP stack
])
def test_moe_heads_that_cannot_be_built_are_refused(tmp_path, change, error):
    import torch
    from safetensors.torch import load_file, save_file

    writer_options = {"packed_experts": True} if change == "half_packed" else {}
    writer = write_tiny_qwen35_moe_mtp if change == "half_packed" else write_tiny_qwen3_next_mtp
    checkpoint = writer(tmp_path / "checkpoint", **{**GEOMETRY, "vocab_size": 256}, **writer_options)
    tensors = load_file(str(checkpoint / "model.safetensors"))
    layer = "mtp.layers.0."
    if change == "fp8_expert":
        name = layer + "mlp.experts.0.gate_proj.weight"
        tensors[name] = tensors[name].to(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = torch.ones(1, 1)
    elif change == "dense_mlp":
        tensors = {k: v for k, v in tensors.items() if ".mlp." not in k}
        for proj, shape in (("gate_proj", (128, HIDDEN)), ("up_proj", (128, HIDDEN)), ("down_proj", (HIDDEN, 128))):
            tensors[f"{layer}mlp.{proj}.weight"] = torch.zeros(shape, dtype=torch.bfloat16)
    elif change == "extra_expert":
        for proj in ("gate_proj", "up_proj", "down_proj"):
            copy = tensors[f"{layer}mlp.experts.0.{proj}.weight"].clone()
            tensors[f"{layer}mlp.experts.{EXPERTS}.{proj}.weight"] = copy
    elif change == "missing_expert":
        del tensors[f"{layer}mlp.experts.{EXPERTS - 1}.down_proj.weight"]
    elif change == "half_packed":
        del tensors[layer + "mlp.experts.down_proj"]
    else:
        tensors["mtp.layers.1.input_layernorm.weight"] = tensors[layer + "input_layernorm.weight"].clone()
    save_file(tensors, str(checkpoint / "model.safetensors"))
    with pytest.raises(error):
        build_qwen35_mtp(checkpoint, tmp_path / "head")
    assert not (tmp_path / "head" / "model.onnx").exists()
