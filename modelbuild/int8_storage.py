"""A head's weight matrices stored as int8 blocks: the numbers its int8 graph computes with.

The heads in ``INT8_HEADS`` run their int8 graph on CPU (``int8_graph``), which quantizes
every weight product symmetrically in blocks of 32 along K. Storing the matrices already
quantized that way halves their committed size (int8 plus one float16 scale per block,
against float16) and changes nothing the int8 graph computes: requantizing q·s finds the same
block maxima and the same q. The float graph (GPU, ``int8_heads: false``) computes with
the dequantized q·s; a draft is only a guess the target verifies, so the head's precision
is its own business (the held-out agreement with and without is in ``docs/models.md``).

In ``model.safetensors`` a stored matrix ``name`` ``[N, K]`` becomes ``name`` (int8,
``[N, K]``) and ``name.block_scale`` (float16, ``[N, K / 32]``); the graph dequantizes it
with nodes named ``dequant/<name>/...``, which onnxruntime folds into a float constant
once, when the session loads.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

BLOCK = 32
SCALE_SUFFIX = ".block_scale"
DEQUANT_PREFIX = "dequant/"


def quantize_blocks(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[N, K]`` -> (int8 ``[N, K]``, float16 scales ``[N, K / 32]``), as the int8 graph quantizes."""
    n, k = weight.shape
    blocks = weight.astype(np.float32).reshape(n, k // BLOCK, BLOCK)
    scale = (np.maximum(np.abs(blocks).max(-1, keepdims=True), 1e-12) / 127).astype(np.float16).astype(np.float32)
    q = np.clip(np.round(blocks / scale), -127, 127).astype(np.int8)
    return q.reshape(n, k), scale[..., 0].astype(np.float16)


def dequantize_blocks(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    n, k = q.shape
    return (q.astype(np.float32).reshape(n, k // BLOCK, BLOCK) * scale.astype(np.float32)[..., None]).reshape(n, k)


def stored_as_int8(shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The weight matrices worth storing as int8 blocks: 2-D, K a multiple of 32, large."""
    return [name for name, shape in shapes.items()
            if len(shape) == 2 and shape[1] % BLOCK == 0 and shape[0] * shape[1] >= 65536]


def dequant_nodes(name: str, n: int, k: int, output: str) -> tuple[list, list]:
    """(nodes, initializers) computing float ``output`` ``[N, K]`` from the stored int8
    ``name`` and its ``name.block_scale``, both external initializers of those names."""
    p = f"{DEQUANT_PREFIX}{name}/"
    shapes = [numpy_helper.from_array(np.array([n, k // BLOCK, BLOCK], np.int64), p + "blocks"),
              numpy_helper.from_array(np.array([n, k // BLOCK, 1], np.int64), p + "scale_shape"),
              numpy_helper.from_array(np.array([n, k], np.int64), p + "matrix")]
    make = helper.make_node
    nodes = [
        make("Cast", [name], [p + "q"], to=TensorProto.FLOAT, name=p + "cast"),
        make("Reshape", [p + "q", p + "blocks"], [p + "q_blocks"], name=p + "reshape_q"),
        make("Cast", [name + SCALE_SUFFIX], [p + "s"], to=TensorProto.FLOAT, name=p + "cast_scale"),
        make("Reshape", [p + "s", p + "scale_shape"], [p + "s_blocks"], name=p + "reshape_scale"),
        make("Mul", [p + "q_blocks", p + "s_blocks"], [p + "w_blocks"], name=p + "mul"),
        make("Reshape", [p + "w_blocks", p + "matrix"], [output], name=p + "reshape_w"),
    ]
    return nodes, shapes
