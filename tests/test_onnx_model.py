"""The ONNX runner: interface discovery, variants real exporters produce, clear refusals.

Variants are real graph edits of the bundled draft model (made with the ``onnx``
package), run by real onnxruntime.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from specserve.engine.model import providers
from specserve.engine.errors import ModelLoadError
from specserve.engine.model.cached_decoder import CachedDecoder
from specserve.engine.model.onnx_model import OnnxDecoder

from .conftest import CPU_CONFIG, DRAFT_DIR, TARGET_DIR


def copy_model(tmp_path: Path) -> Path:
    dest = tmp_path / "model"
    shutil.copytree(DRAFT_DIR, dest)
    return dest


def edit_graph(model_dir: Path, edit) -> None:
    path = model_dir / "model.onnx"
    model = onnx.load(str(path), load_external_data=False)  # keep weights where they are
    edit(model.graph)
    onnx.save(model, str(path))


def run_steps(decoder: OnnxDecoder, tokens: list[int]) -> np.ndarray:
    """Prefill all but the last 3 tokens, then 3 single-token steps; returns all logits."""
    past, logits = decoder.empty_past(), []
    for start, end in [(0, len(tokens) - 3), *[(i, i + 1) for i in range(len(tokens) - 3, len(tokens))]]:
        ids = np.asarray(tokens[start:end])[None]
        out = decoder.forward(ids, np.ones((1, end), np.int64), np.arange(start, end)[None], past)
        past = out.presents
        logits.append(out.logits[0])
    return np.concatenate(logits)


TOKENS = list(range(100, 120))


def test_target_interface_is_discovered_from_the_graph():
    decoder = OnnxDecoder(TARGET_DIR, "cpu")
    manifest_arch = json.loads((TARGET_DIR / "config.json").read_text())
    assert decoder.num_layers == manifest_arch["num_hidden_layers"]
    assert {(g.num_kv_heads, g.head_dim) for g in decoder.layers} == {
        (manifest_arch["num_key_value_heads"], manifest_arch["head_dim"])}
    assert decoder.vocab_size == manifest_arch["vocab_size"] and decoder.kv_dtype == np.float32
    assert decoder.io.position_ids == "position_ids"
    assert "hidden_states" in decoder.io.extra_outputs
    assert sum(name.startswith("aux_hidden.") for name in decoder.io.extra_outputs) == 3
    assert decoder.max_context == manifest_arch["max_position_embeddings"]


def test_pruned_logits_are_rejected(tmp_path):
    model_dir = copy_model(tmp_path)

    def prune(graph):
        for node in graph.node:
            node.output[:] = ["logits_all" if o == "logits" else o for o in node.output]
        graph.initializer.extend([numpy_helper.from_array(np.array([-1]), "p_start"),
                                  numpy_helper.from_array(np.array([2**62]), "p_end"),
                                  numpy_helper.from_array(np.array([1]), "p_axis")])
        graph.node.append(helper.make_node("Slice", ["logits_all", "p_start", "p_end", "p_axis"], ["logits"]))

    edit_graph(model_dir, prune)
    with pytest.raises(ModelLoadError, match="pruned to the last position"):
        OnnxDecoder(model_dir, "cpu")


def test_genai_config_name_templates_are_honoured(tmp_path):
    model_dir = copy_model(tmp_path)

    def rename(graph):
        mapping = {}
        for value in list(graph.input) + list(graph.output):
            name = value.name
            for old, new in (("past_key_values.", "past."), ("present.", "kv_out.")):
                if name.startswith(old):
                    mapping[name] = new + name[len(old):].replace("key", "k").replace("value", "v")
            if name in mapping:
                value.name = mapping[name]
        for node in graph.node:
            node.input[:] = [mapping.get(i, i) for i in node.input]
            node.output[:] = [mapping.get(o, o) for o in node.output]

    edit_graph(model_dir, rename)
    (model_dir / "genai_config.json").write_text(json.dumps({"model": {"decoder": {
        "filename": "model.onnx",
        "inputs": {"past_key_names": "past.%d.k", "past_value_names": "past.%d.v"},
        "outputs": {"present_key_names": "kv_out.%d.k", "present_value_names": "kv_out.%d.v"}}}}))
    renamed = OnnxDecoder(model_dir, "cpu")
    assert renamed.io.past_keys[0] == "past.0.k" and renamed.io.present_values[-1].startswith("kv_out.")
    np.testing.assert_allclose(run_steps(renamed, TOKENS), run_steps(OnnxDecoder(DRAFT_DIR, "cpu"), TOKENS), atol=1e-5)


def _symbolic_kv_dims(graph):
    """What onnxruntime-genai's builder declares: ``[batch_size, kv_heads, past, 'kv_cache_dim']``."""
    for value in graph.input:
        if value.name.startswith("past_key_values."):
            dims = value.type.tensor_type.shape.dim
            dims[1].dim_param, dims[3].dim_param = "kv_heads", "kv_cache_dim"


@pytest.mark.parametrize("declared, error", [
    ({"num_key_value_heads": 2, "head_size": 32}, None),
    ({"num_key_value_heads": 2, "head_size": 16}, "genai_config.json"),  # a wrong size fails the first run
    ({"num_key_value_heads": 2}, "head_size"),  # a size stated nowhere
])
def test_symbolic_kv_sizes_come_from_genai_config_and_are_checked(tmp_path, declared, error):
    model_dir = copy_model(tmp_path)
    edit_graph(model_dir, _symbolic_kv_dims)
    (model_dir / "genai_config.json").write_text(json.dumps({"model": {"decoder": {"filename": "model.onnx",
                                                                                   **declared}}}))
    if error:
        with pytest.raises(ModelLoadError, match=error):
            OnnxDecoder(model_dir, "cpu")
        return
    decoder = OnnxDecoder(model_dir, "cpu")
    assert {(g.num_kv_heads, g.head_dim) for g in decoder.layers} == {(2, 32)}
    np.testing.assert_allclose(run_steps(decoder, TOKENS), run_steps(OnnxDecoder(DRAFT_DIR, "cpu"), TOKENS), atol=1e-5)


def test_models_without_position_ids_are_fed_without_them(tmp_path):
    """GroupQueryAttention exports derive positions from the past length; emulate one."""
    model_dir = copy_model(tmp_path)

    def derive_positions(graph):
        graph.input.remove(next(i for i in graph.input if i.name == "position_ids"))
        graph.initializer.extend([numpy_helper.from_array(np.array(2), "i2"), numpy_helper.from_array(np.array(1), "i1"),
                                  numpy_helper.from_array(np.array([0]), "ax0")])
        graph.node.insert(0, helper.make_node("Shape", ["past_key_values.0.key"], ["pk_shape"]))
        graph.node.insert(1, helper.make_node("Gather", ["pk_shape", "i2"], ["past_len"]))
        graph.node.insert(2, helper.make_node("Shape", ["input_ids"], ["ids_shape"]))
        graph.node.insert(3, helper.make_node("Gather", ["ids_shape", "i1"], ["new_len"]))
        graph.node.insert(4, helper.make_node("Add", ["past_len", "new_len"], ["end"]))
        graph.node.insert(5, helper.make_node("Range", ["past_len", "end", "i1"], ["pos_range"]))
        graph.node.insert(6, helper.make_node("Unsqueeze", ["pos_range", "ax0"], ["position_ids"]))

    edit_graph(model_dir, derive_positions)
    no_positions = OnnxDecoder(model_dir, "cpu")
    assert no_positions.io.position_ids is None
    np.testing.assert_allclose(run_steps(no_positions, TOKENS), run_steps(OnnxDecoder(DRAFT_DIR, "cpu"), TOKENS),
                               atol=1e-5)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        OnnxDecoder(tmp_path / "nowhere", "cpu")
    model_dir = copy_model(tmp_path)
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model.onnx"):
        OnnxDecoder(model_dir, "cpu")
    (model_dir / "model.onnx").unlink()
    with pytest.raises(ModelLoadError, match="ONNX file missing"):
        OnnxDecoder(model_dir, "cpu")


def test_tokenizer_larger_than_the_model_vocab_is_rejected(tmp_path):
    from tokenizers import Tokenizer

    model_dir = copy_model(tmp_path)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(10)])
    tokenizer.save(str(model_dir / "tokenizer.json"))
    with pytest.raises(ModelLoadError, match="tokenizer .* do not match"):
        CachedDecoder(model_dir, CPU_CONFIG)


def test_config_vocab_disagreeing_with_the_graph_is_rejected(tmp_path):
    model_dir = copy_model(tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config["vocab_size"] += 1
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="vocab_size"):
        CachedDecoder(model_dir, CPU_CONFIG)


def test_provider_choice_is_checked_and_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(providers, "_logged", set())
    with caplog.at_level(logging.INFO, logger="specserve.engine"):
        first = OnnxDecoder(DRAFT_DIR, "auto")
        OnnxDecoder(DRAFT_DIR, "auto")
    choices = [r.getMessage() for r in caplog.records if "device=auto" in r.getMessage()]
    assert len(choices) == 1
    assert first.session.get_providers()[0] in choices[0]
    assert OnnxDecoder(DRAFT_DIR, "cpu").session.get_providers() == ["CPUExecutionProvider"]


def test_cuda_request_fails_clearly_where_cuda_cannot_load():
    decoder = OnnxDecoder(DRAFT_DIR, "auto")
    if "CUDAExecutionProvider" in decoder.session.get_providers():
        pytest.skip("CUDA really loads here; the refusal path cannot happen")
    with pytest.raises(ModelLoadError, match="CUDAExecutionProvider did not load"):
        OnnxDecoder(DRAFT_DIR, "cuda")


def test_zero_new_tokens_is_refused_before_onnxruntime():
    decoder = OnnxDecoder(DRAFT_DIR, "cpu")
    with pytest.raises(ValueError, match="new_tokens>=1"):
        decoder.forward(np.zeros((1, 0), np.int64), np.ones((1, 0), np.int64), np.zeros((1, 0), np.int64),
                        decoder.empty_past())
