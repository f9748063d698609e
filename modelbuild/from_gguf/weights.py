"""A GGUF's weights as a decoder graph's ``WeightSource`` (``modelbuild.fused_graph``), in
one of three formats, chosen by measurement (``docs/models.md``):

- ``q4_1`` (the default): every Q4_1 matrix is carried over as it is. onnxruntime's
  ``MatMulNBits`` computes ``x @ (s * (q - 8)).T``; with s = d that is the file's
  ``d * q + m`` minus ``8d + m`` per block, so the product adds back the block sums of
  ``x`` times ``8d + m`` (a ``[.., K/32] x [K/32, N]`` product). Exact, and with no float
  zero points (onnxruntime's slow path, ~10x, ``/work/shared/docs/architecture.md``).
  The Q8_0 embedding table serves as a ``MatMulNBits`` of 8 bits (q + 128, zero point 128):
  exact too. ``accuracy_level`` 4 makes onnxruntime quantise activations to int8: faster,
  no longer exact. There the block sums are those of the activations as quantised (extra
  rows of the same product), and the LM head's activations are refined by a second row
  (``_refined``): the fast format's choices, by fidelity (``docs/models.md``). ``head_rows``
  runs an exact graph's LM head that way too, over enough rows to stay as close to float32
  as a float32 head (the step graph's, ``docs/models.md``, the exact step's head).
- ``fp32``: every matrix dequantised to float32 (the same values, four times the bytes).
- ``int8``: every matrix re-quantised to 8 bits per 32-weight block with a uint8 zero
  point (round to nearest): close to the file's weights, not equal.

Everything is written once into one external-data file that the standard graph and its
in-place graph both reference.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto

from ..fused_graph import MS, _Graph
from .checkpoint import GgufCheckpoint, GgufTensor, q4_1_parts, q8_0_parts

WEIGHT_FORMATS = ("q4_1", "fp32", "int8")
DATA_FILE = "model.onnx.data"
_ALIGN = 64  # onnxruntime maps external data; aligned offsets let it use them in place


class ExternalData:
    """One weights file beside the graphs: each named array is written once, and every
    graph that uses it gets a tensor pointing at the same bytes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handle = open(path, "wb")
        self._where: dict[str, tuple[int, int, int, tuple[int, ...]]] = {}

    def tensor(self, name: str, array: np.ndarray) -> TensorProto:
        if name not in self._where:
            array = np.ascontiguousarray(array)
            offset = self._handle.tell()
            self._handle.write(b"\0" * (-offset % _ALIGN))
            offset = self._handle.tell()
            self._handle.write(array.tobytes())
            dtype = onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
            self._where[name] = (offset, array.nbytes, dtype, array.shape)
        offset, length, dtype, shape = self._where[name]
        proto = TensorProto(name=name, data_type=dtype, dims=list(shape))
        proto.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.path.name), ("offset", str(offset)), ("length", str(length))):
            entry = proto.external_data.add()
            entry.key, entry.value = key, value
        return proto

    def close(self) -> None:
        self._handle.close()


class GgufWeights:
    """The ``WeightSource`` of one GGUF in one of ``WEIGHT_FORMATS``."""

    def __init__(self, checkpoint: GgufCheckpoint, store: ExternalData, weight_format: str = "q4_1",
                 accuracy_level: int = 0, head_rows: int = 0) -> None:
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight format '{weight_format}' is not one of {WEIGHT_FORMATS}")
        if weight_format == "int8":
            accuracy_level = 4  # its only fast kernel (see ``linear``)
        self.checkpoint, self.store, self.format, self.accuracy_level = checkpoint, store, weight_format, accuracy_level
        self.head_rows = head_rows

    def _init(self, g: _Graph, name: str, array: np.ndarray) -> str:
        g.initializers.append(self.store.tensor(name, array))
        return name

    # -- WeightSource ------------------------------------------------------------------
    def vector(self, g: _Graph, name: str, size: int) -> str:
        values = self.checkpoint.tensor(name).dequantize()
        if values.shape != (size,):
            raise ValueError(f"{name}: the file holds {values.shape}, the graph needs ({size},)")
        return self._init(g, name, values)

    def embedding(self, g: _Graph, ids: str, name: str, vocab: int, hidden: int) -> str:
        table = self.checkpoint.tensor(name)
        if table.encoding != "Q8_0":
            return g.one("Gather", [self._init(g, name, table.dequantize()), ids], name="embed")
        # The rows the call needs, dequantised in the graph: exact, and a quarter of the bytes.
        d, q = q8_0_parts(table.data)
        rows = g.one("Cast", [g.one("Gather", [self._init(g, name + ".q8", q.reshape(vocab, hidden)), ids])],
                     to=TensorProto.FLOAT)
        blocks = g.one("Reshape", [rows, g.const("embed_blocks", np.array([0, 0, -1, 32], np.int64))])
        scales = g.one("Unsqueeze", [g.one("Gather", [self._init(g, name + ".d", d), ids]),
                                     g.const("embed_last_axis", np.array([-1], np.int64))])
        return g.one("Reshape", [g.one("Mul", [blocks, scales]),
                                 g.const("embed_rows", np.array([0, 0, hidden], np.int64))], name="embed")

    def linear(self, g: _Graph, x: str, names: list[str], out_sizes: list[int], in_size: int,
               output: str | None = None) -> str:
        tensors = [self.checkpoint.tensor(n) for n in names]
        for tensor, rows in zip(tensors, out_sizes):
            if tensor.shape != (rows, in_size):
                raise ValueError(f"{tensor.name}: the file holds {tensor.shape}, the graph needs ({rows}, {in_size})")
        encodings = {t.encoding for t in tensors}
        label = names[0] if len(names) == 1 else "+".join(names)
        if self.format == "q4_1" and encodings == {"Q4_1"}:
            return self._q4_1(g, x, label, tensors, in_size, output)
        # 8-bit MatMulNBits has a fast kernel only with int8 activations (accuracy level 4):
        # at level 0 the 49152 x 576 LM head took 130 ms a token against fp32's 6.2 ms
        # (docs/models.md), so exact 8-bit weights run as float32.
        if encodings == {"Q8_0"} and names == ["lm_head.weight"] and (self.accuracy_level == 4 or self.head_rows):
            # The logits are the one product whose int8 rounding no later rounding hides:
            # refined over two rows, 98.43 % top-1 against float32 instead of 97.97 %, KL
            # 4.0e-3 instead of 4.9e-3 (docs/models.md, fidelity); over head_rows in an
            # exact graph, as close to float32 as a float32 head, reading 28 MB per pair of
            # rows where float32 reads 113 MB (docs/models.md, the exact step's head).
            refined = self._refined(g, x, in_size, lambda rows: self._q8_0(g, rows, label, tensors, in_size, None, 4),
                                    rows=self.head_rows or 2)
            return refined if output is None else self._finish(g, "Identity", [refined], output)
        if self.accuracy_level == 4 and encodings == {"Q8_0"}:
            return self._q8_0(g, x, label, tensors, in_size, output)
        if self.format == "int8":
            return self._int8(g, x, label, tensors, in_size, output)
        weight = np.concatenate([t.dequantize() for t in tensors]).T  # [in, out] for MatMul
        return self._finish(g, "MatMul", [x, self._init(g, label + ".t", weight)], output)

    # -- products ----------------------------------------------------------------------
    def _q4_1(self, g: _Graph, x: str, label: str, tensors: list[GgufTensor], in_size: int,
              output: str | None) -> str:
        parts = [q4_1_parts(t.data) for t in tensors]
        d = np.concatenate([p[0] for p in parts])
        m = np.concatenate([p[1] for p in parts])
        q = np.concatenate([p[2] for p in parts])
        rows = q.shape[0]
        shift = self._init(g, label + ".shift", np.ascontiguousarray((8.0 * d + m).T))  # [K/32, N]
        if self.accuracy_level == 4:
            # With int8 activations the correction takes the block sums of the activations
            # as the product quantised them, so the whole is the file's weights times one
            # quantised x, as llama.cpp's Q4_1 x Q8_1 dot is. Float sums instead mix two
            # roundings of x: 97.02 % top-1 against 97.97 % (docs/models.md, fidelity).
            # The sums come out of the same product: K/32 extra weight rows, row j 1 on
            # block j and 0 elsewhere (q = 9 and 8 around the zero point 8, scale 1).
            blocks = in_size // 32
            indicator = np.full((blocks, blocks, 32), 8, np.uint8)
            indicator[np.arange(blocks), np.arange(blocks)] = 9
            q = np.concatenate([q, indicator])
            d = np.concatenate([d, np.ones((blocks, blocks), d.dtype)])
            both = self._q4(g, x, label + "+block_sums", q, d, in_size)  # its own arrays in the shared file
            product, sums = g.node("Split", [both, g.const(label + ".split", np.array([rows, blocks], np.int64))],
                                   n_out=2, axis=-1)
        else:
            product, sums = self._q4(g, x, label, q, d, in_size), self._block_sums_of(g, x, in_size)
        if getattr(g, "flat_rows", False):  # x is [rows, K]: the correction adds in as Gemm's C
            return self._finish(g, "Gemm", [sums, shift, product], output, beta=1.0)
        return self._finish(g, "Add", [product, g.one("MatMul", [sums, shift])], output)

    def _q4(self, g: _Graph, x: str, label: str, q: np.ndarray, d: np.ndarray, in_size: int) -> str:
        """``x @ (d * (q - 8)).T`` for 4-bit values ``q [N, K/32, 32]`` and scales ``d [N, K/32]``."""
        packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)  # onnxruntime: pairs in a byte, low first
        return g.one("MatMulNBits", [x, self._init(g, label + ".q4", packed), self._init(g, label + ".s", d.reshape(-1))],
                     domain=MS, K=in_size, N=q.shape[0], bits=4, block_size=32, accuracy_level=self.accuracy_level)

    def _refined(self, g: _Graph, x: str, in_size: int, product, rows: int = 2) -> str:
        """``product(rows)`` of ``x`` to nearly float32 accuracy with int8 activations: ``x``
        as int8 blocks would quantise it, then what that leaves, ``rows`` rows in all, each
        remainder's rounding 1/254 of the one before; the rows' products summed. Row-local,
        so as invariant as the product; at one new token the product's second row costs
        ~1 % (MLAS runs two rows on one pass over the weights; docs/models.md, fidelity)."""
        c = lambda name, value, dtype=np.int64: g.const(name, np.array(value, dtype))  # noqa: E731
        shape = g.one("Shape", [x])
        remainder = g.one("Reshape", [x, c("refine.blocks", [-1, in_size // 32, 32])])
        last_axis, int8_max = c("refine.last_axis", [-1]), c("refine.int8_max", 127.0, np.float32)
        zero, one = c("refine.zero", 0.0, np.float32), c("refine.one", 1.0, np.float32)
        parts = []
        for _ in range(rows - 1):
            scale = g.one("Div", [g.one("ReduceMax", [g.one("Abs", [remainder]), last_axis], keepdims=1), int8_max])
            scale = g.one("Where", [g.one("Equal", [scale, zero]), one, scale])
            coarse = g.one("Mul", [g.one("Round", [g.one("Div", [remainder, scale])]), scale])
            parts.append(g.one("Reshape", [coarse, shape]))
            remainder = g.one("Sub", [remainder, coarse])
        parts.append(g.one("Reshape", [remainder, shape]))
        products = g.node("Split", [product(g.one("Concat", parts, axis=0))], n_out=rows, axis=0, num_outputs=rows)
        total = products[0]
        for part in products[1:]:
            total = g.one("Add", [total, part])
        return total

    def _q8_0(self, g: _Graph, x: str, label: str, tensors: list[GgufTensor], in_size: int,
              output: str | None, accuracy_level: int | None = None) -> str:
        parts = [q8_0_parts(t.data) for t in tensors]
        d = np.concatenate([p[0] for p in parts])
        q = (np.concatenate([p[1] for p in parts]).astype(np.int16) + 128).astype(np.uint8)  # zero point 128
        return self._finish(g, "MatMulNBits", [x, self._init(g, label + ".q8", q), self._init(g, label + ".s", d.reshape(-1))],
                            output, domain=MS, K=in_size, N=q.shape[0], bits=8, block_size=32,
                            accuracy_level=self.accuracy_level if accuracy_level is None else accuracy_level)

    def _int8(self, g: _Graph, x: str, label: str, tensors: list[GgufTensor], in_size: int,
              output: str | None) -> str:
        w = np.concatenate([t.dequantize() for t in tensors]).reshape(-1, in_size // 32, 32)
        low, high = w.min(axis=-1), w.max(axis=-1)
        scale = np.where(high > low, (high - low) / 255.0, 1.0).astype(np.float32)
        zero = np.clip(np.round(-low / scale), 0, 255).astype(np.uint8)
        q = np.clip(np.round(w / scale[..., None]) + zero[..., None], 0, 255).astype(np.uint8)
        inputs = [x, self._init(g, label + ".i8", q), self._init(g, label + ".s8", scale.reshape(-1)),
                  self._init(g, label + ".z8", zero.reshape(-1))]
        return self._finish(g, "MatMulNBits", inputs, output, domain=MS, K=in_size, N=q.shape[0], bits=8,
                            block_size=32, accuracy_level=self.accuracy_level)

    def _block_sums_of(self, g: _Graph, x: str, in_size: int) -> str:
        """``x``'s sums over each 32-wide block of its last axis, ``[.., K/32]``; computed
        once per graph and input (q, k and v share theirs, as do gate and up)."""
        # Kept on the graph: a cache keyed by id(graph) outlived its graph, and a later
        # graph given the same id read sums from nodes it does not have.
        sums: dict[str, str] = g.__dict__.setdefault("block_sums", {})
        if x not in sums and getattr(g, "flat_rows", False):
            # Rows [R, K] -> [R, K/32, 32] -> sums over the last axis: computed row by row,
            # the same bits at any row count (modelbuild.invariant_graph), and no constant
            # to read (a 0/1 matrix here cost ~1.9 ms a decode step in memory traffic:
            # docs/models.md, formats).
            shape, axis = f"row_blocks_of_{in_size}", "sum_last_axis"
            for name, value in ((shape, [-1, in_size // 32, 32]), (axis, [-1])):
                if not any(init.name == name for init in g.initializers):
                    g.const(name, np.array(value, np.int64))
            sums[x] = g.one("ReduceSum", [g.one("Reshape", [x, shape]), axis], keepdims=0)
        if x not in sums:
            blocks = g.one("Reshape", [x, g.const(f"blocks_of_{in_size}_{len(sums)}",
                                                  np.array([0, 0, in_size // 32, 32], np.int64))])
            sums[x] = g.one("ReduceSum", [blocks, g.const(f"sum_last_{len(sums)}", np.array([-1], np.int64))],
                            keepdims=0)
        return sums[x]

    @staticmethod
    def _finish(g: _Graph, op: str, inputs: list[str], output: str | None, **attrs) -> str:
        if output is None:
            return g.one(op, inputs, **attrs)
        g.nodes.append(onnx.helper.make_node(op, inputs, [output], name="lm_head", **attrs))
        return output
