"""Heads' int8 graphs (``model.int8.onnx``, ``modelbuild.int8_graph``): what the builder
writes, what it computes, which graph the engine runs, and that drafting from them keeps
output identical and acceptance where the float heads have it."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from specserve.engine import Engine, GenerationOptions, SpeculativeConfig
from specserve.engine.model.heads import INT8_FILE, load_head
from specserve.engine.speculative.stats import SpeculativeStats

from .conftest import CPU_CONFIG, MODELS

onnx = pytest.importorskip("onnx")
from specserve.modelbuild.int8_graph import INT8_HEADS, build_int8_graph, write_int8_graph  # noqa: E402  (needs onnx)


@pytest.mark.parametrize("kind", INT8_HEADS)
def test_committed_int8_graphs_are_what_the_builder_writes(kind, tmp_path):
    """A stale or hand-edited int8 graph fails here: rebuilt from the committed float graph,
    node for node the same graph."""
    head_dir = MODELS / "heads" / kind
    (tmp_path / "model.onnx").write_bytes((head_dir / "model.onnx").read_bytes())
    (tmp_path / "model.safetensors").write_bytes((head_dir / "model.safetensors").read_bytes())
    write_int8_graph(tmp_path)
    graphs = [onnx.load(str(path), load_external_data=False).graph.SerializeToString()
              for path in (head_dir / INT8_FILE, tmp_path / INT8_FILE)]
    assert graphs[0] == graphs[1]


def _tiny_graph(path, weight16: np.ndarray) -> None:
    """h = x @ Transpose(Cast(w16)), y = h @ h^T: one weight product (as exporters write
    it, float16 weight behind Cast and Transpose) and one product of two activations."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("Cast", ["w16"], ["w32"], to=TensorProto.FLOAT),
             helper.make_node("Transpose", ["w32"], ["wt"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "wt"], ["h"]),
             helper.make_node("Transpose", ["h"], ["ht"], perm=[1, 0]),
             helper.make_node("MatMul", ["h", "ht"], ["y"])]
    n_out, n_in = weight16.shape
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", n_in])],
                              [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["rows", n_out]),
                               helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", "rows"])],
                              [numpy_helper.from_array(weight16, "w16")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save(model, str(path))


def test_the_int8_graph_quantizes_weight_products_in_blocks_row_by_row_and_leaves_activation_products_float(tmp_path):
    rng = np.random.default_rng(0)
    # Columns of very different scales: a scale per block keeps each within int8's
    # resolution (one scale for the whole weight would round the small ones to zero).
    weight = (rng.standard_normal((64, 48 * 2)) * np.geomspace(1e-3, 10.0, 64)[:, None]).astype(np.float16)
    _tiny_graph(tmp_path / "tiny.onnx", weight)
    assert build_int8_graph(tmp_path / "tiny.onnx", tmp_path / "tiny.int8.onnx") == 1
    ops = [n.op_type for n in onnx.load(str(tmp_path / "tiny.int8.onnx")).graph.node]
    assert ops.count("MatMulNBits") == 1 and ops.count("MatMul") == 1  # h @ h^T stays float
    x = rng.standard_normal((3, 96)).astype(np.float32)
    x[1] *= 100.0  # a row far larger than the others
    exact = x.astype(np.float64) @ weight.T.astype(np.float64)
    int8 = ort.InferenceSession(str(tmp_path / "tiny.int8.onnx"), providers=["CPUExecutionProvider"])
    h_float, = ort.InferenceSession(str(tmp_path / "tiny.onnx"), providers=["CPUExecutionProvider"]).run(["h"], {"x": x})
    h_int8, y_int8 = int8.run(["h", "y"], {"x": x})
    np.testing.assert_allclose(h_float, exact, rtol=1e-4, atol=1e-5)
    # int8 on both sides: within ~1 % of each product's magnitude (|x| @ |w|^T), whatever
    # its column's or its row's scale.
    magnitude = np.abs(x).astype(np.float64) @ np.abs(weight.T).astype(np.float64)
    assert (np.abs(h_int8 - exact) <= 0.02 * magnitude).all()
    assert not np.allclose(h_int8, exact, rtol=1e-6, atol=0)  # really quantized
    np.testing.assert_allclose(y_int8, h_int8 @ h_int8.T, rtol=1e-4, atol=1e-3)
    # Each row's result is its own: the same bits alone as beside the large row (so a
    # sequence's drafts do not depend on which sequences share its batch).
    alone = np.concatenate([int8.run(["h"], {"x": x[i : i + 1]})[0] for i in range(3)])
    assert np.array_equal(alone, h_int8)


def test_a_graph_without_weight_products_is_refused(tmp_path):
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "plain",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 2]) for n in "ab"],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, [2, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save(model, str(tmp_path / "plain.onnx"))
    with pytest.raises(ValueError, match="no MatMul over a weight"):
        build_int8_graph(tmp_path / "plain.onnx", tmp_path / "out.onnx")


def test_the_engine_runs_int8_graphs_on_cpu_where_the_bundle_has_them(bundle_engine):
    graphs = {mode: bundle_engine.proposers[mode].model.graph.name for mode in ("mtp", "eagle3", "shared_kv")}
    assert graphs == {"mtp": "model.onnx", **{kind: INT8_FILE for kind in INT8_HEADS}}
    vocab, hidden = bundle_engine.target.decoder.vocab_size, bundle_engine.target.decoder.config["hidden_size"]
    for kind in INT8_HEADS:
        assert load_head(kind, MODELS / "heads" / kind, vocab, hidden, "cpu", 1, int8=False).graph.name == "model.onnx"


def test_float_and_int8_heads_both_keep_output_identical_and_accept_alike(bundle_engine, heldout_prompts):
    """Drafts from the int8 graph differ a little from the float head's; output never does
    (greedy, token-identical to target-only either way), and first-draft acceptance stays
    within a few points of the float head's."""
    config = CPU_CONFIG.model_copy(update={"int8_heads": False,
                                           "speculative": SpeculativeConfig(load=INT8_HEADS, adaptive=False)})
    with Engine(MODELS, config) as float_engine:
        for kind in INT8_HEADS:
            stats = {"int8": SpeculativeStats(), "float": SpeculativeStats()}
            assert float_engine.proposers[kind].model.graph.name == "model.onnx"
            for prompt in heldout_prompts[:6]:
                options = GenerationOptions(max_new_tokens=32, ignore_eos=True, speculative_mode=kind,
                                            num_speculative_tokens=3)
                reference = bundle_engine.generate(prompt, options.model_copy(update={"speculative_mode": "none"}))
                for name, engine in (("int8", bundle_engine), ("float", float_engine)):
                    result = engine.generate(prompt, options)
                    assert result.token_ids == reference.token_ids, (kind, name)
                    stats[name].merge(result.speculative)
            first = {name: s.acceptance_per_position[0] for name, s in stats.items()}
            assert first["int8"] > first["float"] - 0.06, (kind, first)


def test_a_damaged_int8_graph_is_logged_and_the_float_graph_runs(bundle_engine, tmp_path, caplog):
    head_dir = tmp_path / "heads" / "shared_kv"
    head_dir.mkdir(parents=True)
    for name in ("config.json", "model.onnx", "model.safetensors"):
        (head_dir / name).write_bytes((MODELS / "heads/shared_kv" / name).read_bytes())
    (tmp_path / "target").symlink_to(MODELS / "target")  # the head's config names ../../target
    (head_dir / INT8_FILE).write_bytes(b"not an onnx graph")
    vocab, hidden = bundle_engine.target.decoder.vocab_size, bundle_engine.target.decoder.config["hidden_size"]
    with caplog.at_level("WARNING", logger="specserve.engine"):
        head = load_head("shared_kv", head_dir, vocab, hidden, "cpu", 1)
    assert head.graph.name == "model.onnx"
    assert any(INT8_FILE in r.getMessage() and "not used" in r.getMessage() for r in caplog.records)


def _stored_int8_graph(path, q: np.ndarray, scale: np.ndarray) -> None:
    """h = x @ Transpose(w), w dequantized from int8 blocks by ``int8_storage``'s nodes."""
    from onnx import TensorProto, helper, numpy_helper

    from specserve.modelbuild.int8_storage import SCALE_SUFFIX, dequant_nodes

    n_out, n_in = q.shape
    dequant, shapes = dequant_nodes("w", n_out, n_in, "w32")
    nodes = [*dequant, helper.make_node("Transpose", ["w32"], ["wt"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "wt"], ["h"])]
    graph = helper.make_graph(nodes, "stored", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", n_in])],
                              [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["rows", n_out])],
                              [numpy_helper.from_array(q, "w"), numpy_helper.from_array(scale, "w" + SCALE_SUFFIX),
                               *shapes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save(model, str(path))


def test_a_weight_stored_as_int8_blocks_is_what_the_int8_graph_computes_with_and_the_float_graph_dequantizes():
    """A head served as int8 on CPU may store its matrices as the int8 graph's own int8 blocks
    (half the bytes of float16): the float graph computes with q * s, and the int8 graph
    built over it finds the very same q, so its output is bit for bit that of a float q * s."""
    import tempfile
    from pathlib import Path

    from specserve.modelbuild.int8_storage import dequantize_blocks, quantize_blocks

    rng = np.random.default_rng(1)
    weight = (rng.standard_normal((64, 96)) * np.geomspace(1e-3, 10.0, 64)[:, None]).astype(np.float32)
    q, scale = quantize_blocks(weight)
    dequantized = dequantize_blocks(q, scale)
    assert np.array_equal(quantize_blocks(dequantized)[0], q)  # requantizing finds the same int8
    assert np.abs(dequantized - weight).max() <= np.abs(weight).max(axis=1, keepdims=True).max() / 127
    x = rng.standard_normal((3, 96)).astype(np.float32)
    with tempfile.TemporaryDirectory() as scratch:
        stored, plain = Path(scratch) / "stored.onnx", Path(scratch) / "plain.onnx"
        _stored_int8_graph(stored, q, scale)
        _tiny_graph(plain, dequantized)  # the same numbers as a float initializer behind a Cast
        for graph in (stored, plain):
            assert build_int8_graph(graph, graph.with_suffix(".int8.onnx")) == 1
        run = {path.name: ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["h"], {"x": x})[0]
               for path in (stored, stored.with_suffix(".int8.onnx"), plain.with_suffix(".int8.onnx"))}
    np.testing.assert_allclose(run["stored.onnx"], x @ dequantized.T, rtol=1e-5, atol=1e-5)
    assert np.array_equal(run["stored.int8.onnx"], run["plain.int8.onnx"])


def test_the_default_models_int8_served_heads_store_their_matrices_as_int8_blocks():
    from specserve.engine.model.default_model import DEFAULT_MODEL_DIR
    from specserve.modelbuild.int8_storage import SCALE_SUFFIX
    from specserve.modelbuild.weights_file import safetensors_dtypes

    for kind in INT8_HEADS:
        head_dir = DEFAULT_MODEL_DIR / "heads" / kind
        dtypes = safetensors_dtypes(head_dir / "model.safetensors")
        matrices = [name for name, dtype in dtypes.items() if dtype == "I8"]
        assert matrices and all(dtypes[name + SCALE_SUFFIX] == "F16" for name in matrices), kind
        int8_model = onnx.load(str(head_dir / INT8_FILE), load_external_data=False)
        float_graph = onnx.load(str(head_dir / "model.onnx"), load_external_data=False)
        weight_products = sum(n.op_type == "MatMul" for n in float_graph.graph.node) - sum(
            n.op_type == "MatMul" for n in int8_model.graph.node)
        assert weight_products == sum(n.op_type == "MatMulNBits" for n in int8_model.graph.node) >= len(matrices), kind
