"""Write a Llama decoder graph whose every row is computed the same whatever else the call
holds: how many new tokens, how long the past, which sequences share the batch. It is
what makes a format with int8 activations lossless under speculation and batching.

Why onnxruntime's fused graph is not: a decode step's one row and a verify's several take
different MLAS kernels inside the attention ops (MLAS runs a product of one row on a
kernel of its own whose sums are ordered differently), so the same position's hidden
state differs in the last bits between the two. In float32 that moves a logit by ~1e-4;
with int8 activations downstream such a bit moves an activation across a rounding step,
and logits by up to ~3, so a verify's argmax would often not be the decode step's
(``docs/models.md``, row invariance). Measured in onnxruntime 1.31, every other op here
already computes a row from that row alone: ``MatMulNBits`` at either accuracy level, the
norms, rotary, elementwise ops, ``Softmax`` over any number of trailing ``-inf``, and
MLAS's general product at two rows or more, whatever the row count and however many
trailing zero terms.

So attention never runs a one-row product: per (sequence, KV head) the ONNX ``Attention``
op gets one query whose rows are the group's query heads over the call's tokens (three
or more rows for SmolLM2's 9/3 heads; a lone row is padded with a zero row) and an
additive mask that closes every key slot past a row's position with ``-inf``; it reads
the buffer's first mask-width slots (every row's live ones; the rest would only add
closed slots), where closed slots weigh exactly 0. A row's real keys always sit at the
same slots, ``[0, length)``:

- ``in_place=True`` (served calls on CPU, any batch): one buffer per layer, bound as past
  and present, ``[B, kv_heads, capacity, head_dim]``; ``TensorScatter`` writes each
  sequence's new keys and values at its own slot ``sum(mask[b]) - S``, and positions are
  slot indices. A row never holds dead slots, so a rewind is a shorter length.
- ``in_place=False``: ``present = past ++ new`` with the mask closing dead and padded
  slots, for callers that gather pasts (a sliding window, CUDA); rows with dead slots
  there are not guaranteed the same bits as in place.

The residual stream flows as rows ``[B*S, hidden]``, which lets the GGUF's Q4_1 block
correction (``modelbuild.from_gguf.weights``) add into the product in one ``Gemm``; gate
and up are one product. Every row-local op keeps the property: ``MatMulNBits`` at either
accuracy level, the norms, rotary, elementwise ops, and the LM head's two-row refinement.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

from specserve.engine.model.in_place import LOGITS_FROM

from .fused_graph import (MS, HalfSafetensors, WeightSource, _Graph, _rotary_caches, input_norm, read_llama_config,
                          save_decoder, skip_norm)
from .weights_file import WEIGHTS_FILE, aux_output_name

OPSET = 24  # TensorScatter, the in-place write


def build_invariant_decoder(model_dir: Path, out_path: Path, aux_layers: tuple[int, ...] = (),
                            in_place: bool = True, weights: WeightSource | None = None) -> Path:
    """Write ``out_path`` for the Llama checkpoint in ``model_dir``: the interface of
    ``fused_graph.build_fused_decoder`` (``input_ids``, ``attention_mask``, ``position_ids``
    unless ``in_place``, ``past_key_values.*`` in; ``logits``, ``present.*``,
    ``hidden_states``, ``aux_hidden.*`` out), row-invariant (module docstring)."""
    config, (hidden, layers, heads, kv_heads, head_dim, inter, vocab, eps) = read_llama_config(model_dir)
    weights = weights or HalfSafetensors(model_dir / WEIGHTS_FILE)
    g = _Graph()
    g.flat_rows = True  # the weights may use 2-D-only ops (Gemm)
    cos, sin = _rotary_caches(config, head_dim)
    attention = _Attention(g, heads, kv_heads, head_dim, in_place, g.const("cos_cache", cos), g.const("sin_cache", sin))

    x = weights.embedding(g, "input_ids", "model.embed_tokens.weight", vocab, hidden)
    x = g.one("Reshape", [x, g.const("rows_shape", np.array([-1, hidden], np.int64))])
    aux_outputs: dict[int, str] = {0: x} if 0 in aux_layers else {}
    residual, pending = x, None
    presents: list[str] = []
    for i in range(layers):
        p = f"model.layers.{i}."
        normed, residual = input_norm(g, weights, p, residual, pending, hidden, eps)
        if i in aux_layers and i > 0:
            aux_outputs[i] = residual
        qkv = weights.linear(g, normed, [p + f"self_attn.{n}_proj.weight" for n in "qkv"],
                             [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], hidden)
        present = (f"present.{i}.key", f"present.{i}.value")
        attended = attention.layer(i, qkv, (f"past_key_values.{i}.key", f"past_key_values.{i}.value"), present)
        presents += present
        attn_out = weights.linear(g, attended, [p + "self_attn.o_proj.weight"], [hidden], heads * head_dim)
        post_w = weights.vector(g, p + "post_attention_layernorm.weight", hidden)
        normed, residual = skip_norm(g, attn_out, residual, post_w, eps)
        gate_up = weights.linear(g, normed, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], [inter, inter], hidden)
        gate, up = g.node("Split", [gate_up, g.const(f"gate_up_split{i}", np.array([inter, inter], np.int64))],
                          n_out=2, axis=-1)
        act = g.one("Mul", [g.one("Mul", [gate, g.one("Sigmoid", [gate])]), up])
        pending = weights.linear(g, act, [p + "mlp.down_proj.weight"], [hidden], inter)
    final, residual = skip_norm(g, pending, residual, weights.vector(g, "model.norm.weight", hidden), eps)
    if layers in aux_layers:
        aux_outputs[layers] = residual
    by_sequence = lambda value, width, name: g.nodes.append(helper.make_node(  # noqa: E731
        "Reshape", [value, attention.sequence_shape(width)], [name], name=f"out/{name}"))
    if in_place:
        # Logits of each sequence's new tokens from LOGITS_FROM on: a prefill needs its last
        # row's only, and the LM head is the dearest product of a long prompt's rows. Rows
        # are cut, not computed otherwise, so the ones kept stay invariant.
        c = lambda name, value: g.const(name, np.array(value, np.int64))  # noqa: E731
        by_new = g.one("Reshape", [final, attention.sequence_shape(hidden)])                 # [B, S, hidden]
        kept = g.one("Slice", [by_new, LOGITS_FROM, c("logits.end", [np.iinfo(np.int64).max]), c("logits.axis", [1])])
        logits = weights.linear(g, g.one("Reshape", [kept, c("logits.rows", [-1, hidden])]), ["lm_head.weight"],
                                [vocab], hidden)
        batch = g.one("Slice", [g.one("Shape", ["input_ids"]), c("logits.batch_start", [0]), c("logits.batch_end", [1])])
        shape = g.one("Concat", [batch, c("logits.rest", [-1, vocab])], axis=0)                  # [B, S', vocab]
        g.nodes.append(helper.make_node("Reshape", [logits, shape], ["logits"], name="out/logits"))
    else:
        by_sequence(weights.linear(g, final, ["lm_head.weight"], [vocab], hidden), vocab, "logits")
    by_sequence(final, hidden, "hidden_states")
    for j in aux_layers:
        by_sequence(aux_outputs[j], hidden, aux_output_name(j))

    extra = [helper.make_tensor_value_info(LOGITS_FROM, TensorProto.INT64, [1])] if in_place else []
    return save_decoder(g, out_path, "llama_row_invariant", "specserve.modelbuild.invariant_graph", OPSET, in_place,
                        presents, aux_layers, vocab, hidden, kv_heads, head_dim, extra_inputs=extra)


class _Attention:
    """The row-invariant attention of every layer, and the per-call values it shares
    (positions, the key mask, shapes); see the module docstring."""

    def __init__(self, g: _Graph, heads: int, kv_heads: int, head_dim: int, in_place: bool,
                 cos_cache: str, sin_cache: str) -> None:
        self.g, self.heads, self.kv_heads, self.head_dim, self.in_place = g, heads, kv_heads, head_dim, in_place
        self.cos_cache, self.sin_cache = cos_cache, sin_cache
        self.group = heads // kv_heads
        # MLAS computes a product of one row on a kernel of its own: a group of one query
        # head (multi-head attention) at one new token gets a zero row beside it.
        self.pad_row = self.group == 1
        c = lambda name, values: g.const(name, np.array(values, np.int64))  # noqa: E731
        self._c = c
        batch_and_new = g.one("Shape", ["input_ids"])                                     # [B, S]
        new = g.one("Gather", [batch_and_new, c("att.index1", 1)])
        zero, one = c("att.zero", 0), c("att.one", 1)
        steps = g.one("Range", [zero, new, one])                                          # [S]
        if in_place:
            # Each sequence's past is its mask's sum less the call's new tokens; the new
            # tokens' slots (and positions) follow it.
            filled = g.one("ReduceSum", ["attention_mask", c("att.axis1", [1])], keepdims=0)  # [B]
            self.write_index = g.one("Sub", [filled, new])
            self.position_ids = g.one("Add", [g.one("Unsqueeze", [self.write_index, c("att.axis1b", [1])]),
                                              g.one("Unsqueeze", [steps, c("att.axis0", [0])])])  # [B, S]
            # The products read slots [0, mask width) of the buffer, not all of it: every
            # row's live slots lie below the mask's width, and the rest would only add
            # closed slots (docs/models.md, where the fast step's time goes).
            slots = g.one("Gather", [g.one("Shape", ["attention_mask"]), one])
            self.read_slots = (c("att.read_start", [0]), g.one("Unsqueeze", [slots, c("att.axis0s", [0])]),
                               c("att.read_axis", [2]))
            open_ = g.one("LessOrEqual", [
                g.one("Unsqueeze", [g.one("Range", [zero, slots, one]), c("att.axes01", [0, 1])]),  # [1, 1, T]
                g.one("Unsqueeze", [self.position_ids, c("att.axis2", [2])])])                   # [B, S, 1]
        else:
            # Cache-index space, as fused_graph's: slot t is open to new token s where the
            # mask opens it and t <= P + s (pasts and new tokens right-padded).
            self.position_ids = "position_ids"
            total = g.one("Gather", [g.one("Shape", ["attention_mask"]), one])
            past = g.one("Sub", [total, new])
            causal = g.one("LessOrEqual", [
                g.one("Unsqueeze", [g.one("Range", [zero, total, one]), c("att.axis0", [0])]),
                g.one("Unsqueeze", [g.one("Add", [steps, past]), c("att.axis1", [1])])])       # [S, T]
            open_ = g.one("And", [g.one("Unsqueeze", [causal, c("att.axis0b", [0])]),
                                  g.one("Unsqueeze", [g.one("Cast", ["attention_mask"], to=TensorProto.BOOL),
                                                      c("att.axis1c", [1])])])                 # [B, S, T]
        bias = g.one("Where", [open_, g.const("att.open", np.array(0.0, np.float32)),
                               g.const("att.closed", np.array(-np.inf, np.float32))])          # [B, S, T]
        # The product's rows are (query head of the group, new token): [B, 1, G*S, T].
        rows = g.one("Expand", [g.one("Unsqueeze", [bias, c("att.axes12", [1, 2])]), c("att.expand_head", [1, 1, self.group, 1, 1])])
        slots_dim = g.one("Slice", [g.one("Shape", [bias]), c("att.start2", [2]), c("att.end3", [3])])  # [T]
        self.bias = g.one("Reshape", [rows, g.one("Concat", [c("att.bias_dims", [0, 1, -1]), slots_dim], axis=0)])
        if self.pad_row:
            self.bias = g.one("Pad", [self.bias, c("att.pad_bias", [0, 0, 0, 0, 0, 0, 1, 0])])
        self.split = c("att.qk_v_split", [(heads + kv_heads) * head_dim, kv_heads * head_dim])
        self.heads_split = c("att.q_k_split", [heads, kv_heads])
        self.by_head = {n: g.one("Concat", [batch_and_new, c(f"att.heads_dims{n}", [n, head_dim])], axis=0)
                        for n in {heads + kv_heads, kv_heads}}                               # [B, S, n, hd]
        self.group_rows = c("att.group_rows", [0, kv_heads, -1, head_dim])                   # [B, kvh, G*S, hd]
        self.heads_shape = g.one("Concat", [g.one("Slice", [batch_and_new, c("att.start0", [0]), c("att.end1", [1])]),
                                            c("att.heads_rest", [heads, -1, head_dim])], axis=0)  # [B, H, S, hd]
        self.rows_shape = c("att.rows_shape", [-1, heads * head_dim])
        self.batch_and_new = batch_and_new

    def sequence_shape(self, width: int) -> str:
        """``[B, S, width]``, to give row outputs their per-sequence shape."""
        name = f"att.sequence_shape{width}"
        if not any(node.output[0] == name for node in self.g.nodes):
            self.g.nodes.append(helper.make_node("Concat", [self.batch_and_new, self._c(f"att.width{width}", [width])],
                                                 [name], name=name, axis=0))
        return name

    def _heads_first(self, x: str, n: int) -> str:
        """Rows ``[B*S, n*hd]`` -> ``[B, n, S, hd]``."""
        return self.g.one("Transpose", [self.g.one("Reshape", [x, self.by_head[n]])], perm=[0, 2, 1, 3])

    def _rotated(self, x: str, n: int) -> str:
        return self.g.one("RotaryEmbedding", [x, self.position_ids, self.cos_cache, self.sin_cache], domain=MS,
                          interleaved=0, num_heads=n)

    def layer(self, i: int, qkv: str, past: tuple[str, str], present: tuple[str, str]) -> str:
        """The attention of layer ``i`` over its packed projection rows ``qkv``; writes
        the layer's presents and returns its output rows ``[B*S, heads*hd]``."""
        g, c = self.g, self._c
        # Queries and keys are adjacent in the packed projection: one rotary for both.
        qk, v = g.node("Split", [qkv, self.split], n_out=2, axis=-1)
        rotated = self._rotated(self._heads_first(qk, self.heads + self.kv_heads), self.heads + self.kv_heads)
        query, keys = g.node("Split", [rotated, self.heads_split], n_out=2, axis=1)  # [B, H, S, hd], [B, kvh, S, hd]
        values = self._heads_first(v, self.kv_heads)
        for past_name, new, present_name in ((past[0], keys, present[0]), (past[1], values, present[1])):
            if self.in_place:
                g.nodes.append(helper.make_node("TensorScatter", [past_name, new, self.write_index], [present_name],
                                                name=f"kv_write/{present_name}", axis=2))
            else:
                g.nodes.append(helper.make_node("Concat", [past_name, new], [present_name],
                                                name=f"kv_concat/{present_name}", axis=2))
        rows = g.one("Reshape", [query, self.group_rows])                          # [B, kvh, G*S, hd]
        if self.pad_row:
            rows = g.one("Pad", [rows, c(f"att.pad_rows{i}", [0, 0, 0, 0, 0, 0, 1, 0])])
        keys_read, values_read = present
        if self.in_place:
            keys_read, values_read = (g.one("Slice", [buffer, *self.read_slots]) for buffer in present)
        # The ONNX Attention op over the grouped rows: per (sequence, KV head) the same
        # products as written out (G*S rows, never one), in one node instead of four
        # (0.4 ms a step less, docs/models.md), and as invariant (tests/test_target_formats.py).
        out = g.one("Attention", [rows, keys_read, values_read, self.bias],
                    scale=float(self.head_dim ** -0.5))                             # [B, kvh, G*S, hd]
        if self.pad_row:
            out = g.one("Slice", [out, c(f"att.row_start{i}", [0]), c(f"att.row_end{i}", [-1]), c(f"att.row_axis{i}", [2])])
        by_token = g.one("Transpose", [g.one("Reshape", [out, self.heads_shape])], perm=[0, 2, 1, 3])  # [B, S, H, hd]
        return g.one("Reshape", [by_token, self.rows_shape], name=f"attn{i}")
