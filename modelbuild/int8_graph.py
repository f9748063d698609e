"""Write a head's int8 graph (``model.int8.onnx``): the same graph, whose weight products
run as int8 matrix products, over the very same float16 weights file.

Why: on CPU a head's step is a few small matrix-vector products, and its time is the
time to read its weights. After each target run has streamed the target's ~50 MB through
the caches, a head's first run reads its weights from memory: in-process at one stream
0.72 ms for the shared-KV assistant's first run of a round against 0.31 ms for the rest
(EAGLE-3 0.59 / 0.20). int8 weights are a quarter of the float32 bytes onnxruntime
computes with. A draft only has to be a good guess (every draft is verified by the
target, so output is unchanged whatever the head computes), so its precision is the
head's own business.

How, without a second copy of the weights: each ``MatMul`` whose right side is a weight
(an initializer, possibly behind ``Cast``/``Transpose``, as the exporter writes them)
becomes onnxruntime's ``MatMulNBits`` (8 bits, blocks of 32 along K, each with its own
scale, symmetric; ``accuracy_level`` 4: int8 products). The weight's quantization is
written as graph nodes over the float weight (``Abs``, ``ReduceMax``, ``Div``, ``Round``,
``Clip``, ``Cast``); onnxruntime folds them into uint8 constants once, when the session
loads, and prepacks those. So the committed bundle gains only the graph (~60 KB a head),
not int8 weights. Products of two activations (the shared-KV assistant's attention over
the target's KV) stay float. ``MatMulNBits`` quantizes its input per row and block, so
each row's result depends on that row alone: a sequence's drafts are the same whichever
sequences share its batch. (onnxruntime's dynamic quantization -- ``DynamicQuantizeLinear``
+ ``MatMulInteger``, what ``quantize_dynamic`` writes -- was as fast, but takes one scale
for the whole input tensor: batched drafts differed from solo ones, and a seeded sampled
request's tokens would have depended on its neighbours.)

Measured here (one thread, the engine's head setting): the shared-KV assistant's run
0.19 -> 0.12 ms warm, 0.71-0.93 -> 0.47-0.51 ms with its weights out of the caches;
in-process at one stream, k = 4, 12 held-out prompts x 5 alternating passes: shared-KV
1.07x -> 1.38x target-only (first-draft acceptance 0.661 -> 0.652), EAGLE-3 1.35x ->
1.52x (0.611 -> 0.617). MTP's head showed no clear gain (fixed k 1.31x -> 1.38x,
adaptive 1.36x -> 1.30x, same bench: its graph holds 3 MB of weights, and its LM head,
the target's 4 MB, runs outside it), so it gets no int8 graph: ``INT8_HEADS``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specserve.engine.model.heads import INT8_FILE

from .int8_storage import DEQUANT_PREFIX
from .weights_file import IR_VERSION

MS = "com.microsoft"

INT8_HEADS = ("eagle3", "shared_kv")  # where the int8 graph measured faster (module docstring)
BLOCK = 32  # weights along K quantized in blocks of this many, each with its own scale
_WEIGHT_PATH_OPS = ("Cast", "Transpose")
_MAX, _MIN, _EPS, _ZERO = "int8.max", "int8.min", "int8.eps", "int8.zero_point"


def _weight_shape(name: str, producers: dict[str, onnx.NodeProto],
                  initializers: dict[str, onnx.TensorProto]) -> tuple[int, int] | None:
    """``(K, N)`` of a ``MatMul``'s right side computed from a 2-D initializer through
    ``Cast``/``Transpose`` (and a stored int8 weight's dequantization) only, or None (an
    activation, or a shape this cannot quantize)."""
    transposes = 0
    while name not in initializers:
        node = producers.get(name)
        if node is not None and node.name.startswith(DEQUANT_PREFIX):  # a weight stored as int8 blocks
            name = node.input[0]
            continue
        if node is None or node.op_type not in _WEIGHT_PATH_OPS:
            return None
        if node.op_type == "Transpose":
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0])
            if perm != [1, 0]:
                return None
            transposes += 1
        name = node.input[0]
    dims = list(initializers[name].dims)
    if len(dims) != 2:
        return None
    k, n = dims if transposes % 2 == 0 else dims[::-1]
    return (k, n) if k % BLOCK == 0 else None


def _int8_product(node: onnx.NodeProto, k: int, n: int, prefix: str) -> list[onnx.NodeProto]:
    """``node`` (``MatMul(a, w)``, w ``[K, N]`` float) as ``MatMulNBits`` over w quantized
    in blocks by foldable nodes. Its int8 computation quantizes ``a`` per row and block,
    so each row's result depends on that row alone: a sequence's drafts are the same
    whichever sequences share its batch (``DynamicQuantizeLinear``, one scale per tensor,
    would tie them together, and seeded sampling with them)."""
    a, w = node.input
    p, make = prefix, helper.make_node
    shape = numpy_helper.from_array(np.array([n, k // BLOCK, BLOCK], np.int64), p + "blocks_shape")
    flat = numpy_helper.from_array(np.array([n * (k // BLOCK)], np.int64), p + "scales_shape")
    return [
        make("Constant", [], [p + "blocks_shape"], value=shape),
        make("Constant", [], [p + "scales_shape"], value=flat),
        make("Transpose", [w], [p + "w_by_column"], perm=[1, 0]),
        make("Reshape", [p + "w_by_column", p + "blocks_shape"], [p + "w_blocks"]),
        make("Abs", [p + "w_blocks"], [p + "abs"]),
        make("ReduceMax", [p + "abs"], [p + "block_max"], axes=[2], keepdims=1),
        make("Max", [p + "block_max", _EPS], [p + "block_max_safe"]),
        make("Div", [p + "block_max_safe", _MAX], [p + "scale"]),
        make("Div", [p + "w_blocks", p + "scale"], [p + "w_scaled"]),
        make("Round", [p + "w_scaled"], [p + "w_rounded"]),
        make("Clip", [p + "w_rounded", _MIN, _MAX], [p + "w_clipped"]),
        make("Add", [p + "w_clipped", _ZERO], [p + "w_shifted"]),
        make("Cast", [p + "w_shifted"], [p + "w_uint8"], to=TensorProto.UINT8),
        make("Reshape", [p + "scale", p + "scales_shape"], [p + "scales"]),
        # accuracy_level 4: int8 products (activations quantized per row and block).
        make("MatMulNBits", [a, p + "w_uint8", p + "scales"], list(node.output), name=node.name + "/int8",
             domain=MS, K=k, N=n, bits=8, block_size=BLOCK, accuracy_level=4),
    ]


def build_int8_graph(source: Path, out: Path) -> int:
    """Write ``source``'s int8 graph to ``out`` (same directory: it reads the same external
    weights file); return how many products were quantized."""
    model = onnx.load(str(source), load_external_data=False)
    graph = model.graph
    producers = {output: node for node in graph.node for output in node.output}
    initializers = {init.name: init for init in graph.initializer}
    nodes, count = [], 0
    for node in graph.node:
        shape = _weight_shape(node.input[1], producers, initializers) if node.op_type == "MatMul" else None
        if shape is not None:
            nodes.extend(_int8_product(node, *shape, f"int8/{count}/"))
            count += 1
        else:
            nodes.append(node)
    if count == 0:
        raise ValueError(f"{source}: no MatMul over a weight to quantize")
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend([numpy_helper.from_array(np.array(127.0, np.float32), _MAX),
                              numpy_helper.from_array(np.array(-127.0, np.float32), _MIN),
                              numpy_helper.from_array(np.array(1e-12, np.float32), _EPS),
                              numpy_helper.from_array(np.array(128.0, np.float32), _ZERO)])
    if not any(o.domain == MS for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS, 1))
    model.ir_version = min(model.ir_version, IR_VERSION) if model.ir_version else IR_VERSION
    onnx.save(model, str(out))
    onnx.checker.check_model(str(out))  # by path: the external weights resolve beside it
    return count


def write_int8_graph(head_dir: Path) -> int:
    """``head_dir/model.onnx`` -> ``head_dir/INT8_FILE``; how many products were quantized."""
    return build_int8_graph(head_dir / "model.onnx", head_dir / INT8_FILE)


def main() -> None:
    """Write the int8 graph of each head directory given: ``python -m specserve.modelbuild.int8_graph
    models/fixture/heads/eagle3 models/fixture/heads/shared_kv``. Needs only onnx (no torch, no retraining)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("head_dirs", type=Path, nargs="+")
    for head_dir in parser.parse_args().head_dirs:
        print(f"{head_dir / INT8_FILE}: {write_int8_graph(head_dir)} weight products as int8")


if __name__ == "__main__":
    main()
