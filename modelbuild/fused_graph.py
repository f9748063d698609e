"""Write a Llama decoder graph that onnxruntime runs at its best, straight from the
checkpoint (no tracing).

Why not the traced export: torch's tracer leaves ~900 ``Constant``, ~700 ``Unsqueeze``
and per-head Transpose/Slice/Concat chains for rotary and attention, which onnxruntime
cannot fuse. This builder writes the graph the way onnxruntime-genai's model builder
does: one packed QKV MatMul, fused ``SkipSimplifiedLayerNormalization`` (residual add +
RMSNorm), the ``RotaryEmbedding`` contrib op fed the caller's ``position_ids`` (absolute
positions survive a sliding window), and a fused attention op. The interface stays the
one the engine already serves (``input_ids``, ``attention_mask``, ``position_ids``,
``past_key_values.*`` in, ``logits``, ``present.*``, ``hidden_states``, ``aux_hidden.*``
out), so the bundle, the heads and the KV cache are unchanged.

Attention is the ONNX ``Attention`` op (opset 23) with an explicit boolean mask and concat
semantics (present = past ++ new), so any batch with any number of right-padded new
tokens works, which batched verification needs. onnxruntime-genai's
``GroupQueryAttention`` measured the same per call here (1.87 vs 1.90 ms per decode step,
2.27 vs 2.23 ms per 5-token verify, 2 threads) but refuses multi-token steps after a past
at batch > 1.

Weights stay float16 in ``model.safetensors`` (external data) behind a ``Cast``:
onnxruntime folds the casts, transposes and concatenations of initializers once at
session load, so nothing is cast per call and the committed bundle stays small.

``in_place=True`` writes the graph's in-place graph for calls at batch 1 (``model.inplace.onnx``,
run by ``engine.model.in_place``): ``GroupQueryAttention`` on the packed QKV projection,
rotary inside it, whose past and present are one preallocated buffer per sequence
(bound to both through IO binding), written in place at slot ``sum(attention_mask) -
new tokens``. Nothing is concatenated or copied per call and a rewind is a shorter mask.
Positions are slot indices (no ``position_ids``), so the past must be contiguous: no
dead slots in the middle, no sliding window. Measured here against the standard graph
in a decode loop at batch 1 (interleaved, 256 calls each): 0.88x the time per call, 1
and 5 new tokens alike. It serves batch 1 only: onnxruntime's ``GroupQueryAttention``
refuses several new tokens after a past at batch > 1, which batched verification needs.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np
import onnx
from onnx import TensorProto, helper

from .weights_file import IR_VERSION, WEIGHTS_FILE, aux_output_name, safetensors_offsets

OPSET = 23  # the standard Attention op
IN_PLACE_FILE = "model.inplace.onnx"  # the in-place graph for batch 1 (``in_place=True``), beside model.onnx
FUSED_IR_VERSION = max(IR_VERSION, 11)  # opset 23 needs IR >= 11; onnxruntime 1.31 reads <= 13
MS = "com.microsoft"


class _Graph:
    """Accumulates nodes, initializers and value names with unique, readable names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0

    def node(self, op: str, inputs: list[str], n_out: int = 1, domain: str = "", name: str | None = None,
             **attrs) -> list[str]:
        self._count += 1
        label = name or f"{op}_{self._count}"
        outputs = [f"{label}/out{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=label, domain=domain, **attrs))
        return outputs

    def one(self, op: str, inputs: list[str], **kw) -> str:
        return self.node(op, inputs, **kw)[0]

    def const(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(onnx.numpy_helper.from_array(array, name))
        return name


def skip_norm(g: "_Graph", x: str, residual: str, weight: str, eps: float) -> tuple[str, str]:
    """``SkipSimplifiedLayerNormalization``: the residual stream plus ``x``, and its RMS norm
    times ``weight``. Returns the normalised value and the new stream. The node's mean and
    inverse-deviation outputs are left unnamed: asked for, they cost the fast format's step
    ~0.4 ms in the 60 norms (docs/models.md, where the fast step's time goes)."""
    normed, _, _, stream = g.node("SkipSimplifiedLayerNormalization", [x, residual, weight], n_out=4, domain=MS,
                                  epsilon=eps)
    g.nodes[-1].output[1] = g.nodes[-1].output[2] = ""
    return normed, stream


def input_norm(g: "_Graph", weights: "WeightSource", prefix: str, residual: str, pending: str | None,
               hidden: int, eps: float) -> tuple[str, str]:
    """A layer's input norm: of the residual stream, or (after the first layer) of the
    stream plus the last layer's pending MLP output, added in the same node. Returns the
    normalised input and the stream."""
    norm_w = weights.vector(g, prefix + "input_layernorm.weight", hidden)
    if pending is None:
        return g.one("SimplifiedLayerNormalization", [residual, norm_w], axis=-1, epsilon=eps), residual
    return skip_norm(g, pending, residual, norm_w, eps)


class WeightSource(Protocol):
    """Where a decoder graph's weights come from and how each product with them is
    computed: float16 safetensors behind a ``Cast`` (the bundle's own models) or a GGUF's
    blocks carried over as they are (``modelbuild.from_gguf.weights``). Names are
    Hugging Face's (``model.layers.{i}.self_attn.q_proj.weight``, ``lm_head.weight``)."""

    def vector(self, g: _Graph, name: str, size: int) -> str:
        """A float32 ``[size]`` value (a norm's weight)."""

    def embedding(self, g: _Graph, ids: str, name: str, vocab: int, hidden: int) -> str:
        """The float32 rows ``[..., hidden]`` of table ``name`` for token ids ``ids``."""

    def linear(self, g: _Graph, x: str, names: list[str], out_sizes: list[int], in_size: int,
               output: str | None = None) -> str:
        """``x @ concat(W_names).T``: the Linear layers ``names`` (``[out, in]`` each) applied
        to ``x [..., in]`` as one product, optionally written to value ``output``."""


class HalfSafetensors:
    """Float16 tensors of a safetensors file, referenced in place as external data and
    cast to float32 in the graph (onnxruntime folds the casts, transposes and
    concatenations of initializers once at session load)."""

    def __init__(self, path: Path) -> None:
        self.offsets = safetensors_offsets(path)
        self.file = path.name

    def _weight(self, g: _Graph, name: str, shape: tuple[int, ...]) -> str:
        offset, length = self.offsets[name]
        if length != int(np.prod(shape)) * 2:
            raise RuntimeError(f"{name}: checkpoint holds {length} bytes, expected float16 {shape}")
        half = TensorProto(name=name + ".fp16", data_type=TensorProto.FLOAT16, dims=list(shape))
        half.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.file), ("offset", str(offset)), ("length", str(length))):
            entry = half.external_data.add()
            entry.key, entry.value = key, value
        g.initializers.append(half)
        return g.one("Cast", [half.name], to=TensorProto.FLOAT, name=f"cast/{name}")

    def vector(self, g: _Graph, name: str, size: int) -> str:
        return self._weight(g, name, (size,))

    def embedding(self, g: _Graph, ids: str, name: str, vocab: int, hidden: int) -> str:
        return g.one("Gather", [self._weight(g, name, (vocab, hidden)), ids], name="embed")

    def linear(self, g: _Graph, x: str, names: list[str], out_sizes: list[int], in_size: int,
               output: str | None = None) -> str:
        # ``[in, sum(out)]``: HF Linear weights ``[out, in]``, concatenated on the output
        # axis then transposed (folded into one initializer at load).
        parts = [self._weight(g, n, (o, in_size)) for n, o in zip(names, out_sizes)]
        packed = parts[0] if len(parts) == 1 else g.one("Concat", parts, axis=0)
        weight = g.one("Transpose", [packed], perm=[1, 0])
        if output is None:
            return g.one("MatMul", [x, weight])
        g.nodes.append(helper.make_node("MatMul", [x, weight], [output], name="lm_head"))
        return output


class LlamaDims(NamedTuple):
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    eps: float


def read_llama_config(model_dir: Path) -> tuple[dict, LlamaDims]:
    """A plain Llama checkpoint's config.json and its dimensions; anything else is refused."""
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") != "llama" or config.get("rope_scaling"):
        raise ValueError(f"{model_dir}: only plain Llama (no rope scaling) is supported, got {config.get('model_type')}")
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    return config, LlamaDims(hidden, int(config["num_hidden_layers"]), heads, int(config["num_key_value_heads"]),
                             int(config.get("head_dim") or hidden // heads), int(config["intermediate_size"]),
                             int(config["vocab_size"]), float(config["rms_norm_eps"]))


def _rotary_caches(config: dict, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    theta = float(config.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    # Rows for 4x the trained context: an engine whose ``max_context`` is raised past the
    # model's (or that slides a window) still finds its absolute positions in the cache.
    positions = np.arange(4 * int(config["max_position_embeddings"]), dtype=np.float64)
    freqs = np.outer(positions, inv_freq)
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)


def build_fused_decoder(model_dir: Path, out_path: Path, aux_layers: tuple[int, ...] = (),
                        in_place: bool = False, weights: WeightSource | None = None) -> Path:
    """Write ``out_path`` for the Llama checkpoint in ``model_dir`` (config.json +
    model.safetensors); ``aux_layers`` adds ``aux_hidden.{j}``, the residual stream
    entering layer j (HF ``hidden_states[j]``). ``in_place``: the in-place graph (batch 1) with one
    shared past/present buffer per sequence (module docstring)."""
    config, (hidden, layers, heads, kv_heads, head_dim, inter, vocab, eps) = read_llama_config(model_dir)
    weights = weights or HalfSafetensors(model_dir / WEIGHTS_FILE)
    g = _Graph()

    cos, sin = _rotary_caches(config, head_dim)
    cos_cache, sin_cache = g.const("cos_cache", cos), g.const("sin_cache", sin)
    if in_place:
        # GroupQueryAttention reads the past's length from the mask: seqlens_k = its sum - 1
        # (the last real slot), total = its width; new tokens go to slots sum - S onwards.
        seqlens = g.one("Cast", [g.one("Sub", [
            g.one("ReduceSum", ["attention_mask", g.const("axis1", np.array([1], np.int64))], keepdims=0),
            g.const("one_i64", np.array(1, np.int64))])], to=TensorProto.INT32)
        width = g.one("Gather", [g.one("Shape", ["attention_mask"]), g.const("index1", np.array(1, np.int64))])
        total = g.one("Cast", [width], to=TensorProto.INT32)
    else:
        # Allowed[b, 0, s, t] = attention_mask[b, t] and t <= P + s (causal in cache-index
        # space, so right-padded pasts and right-padded new tokens both work).
        total = g.one("Gather", [g.one("Shape", ["attention_mask"]), g.const("index1", np.array(1, np.int64))])
        new = g.one("Gather", [g.one("Shape", ["input_ids"]), g.const("index1b", np.array(1, np.int64))])
        zero, one = g.const("zero_i64", np.array(0, np.int64)), g.const("one_i64", np.array(1, np.int64))
        past_len = g.one("Sub", [total, new])
        q_index = g.one("Add", [g.one("Range", [zero, new, one]), past_len])
        k_index = g.one("Range", [zero, total, one])
        causal = g.one("LessOrEqual", [g.one("Unsqueeze", [k_index, g.const("axis0", np.array([0], np.int64))]),
                                       g.one("Unsqueeze", [q_index, g.const("axis1b", np.array([1], np.int64))])])
        padded = g.one("Unsqueeze", [g.one("Cast", ["attention_mask"], to=TensorProto.BOOL),
                                     g.const("axes12", np.array([1, 2], np.int64))])
        allowed = g.one("And", [g.one("Unsqueeze", [causal, g.const("axes01", np.array([0, 1], np.int64))]), padded])

    x = weights.embedding(g, "input_ids", "model.embed_tokens.weight", vocab, hidden)
    aux_outputs: dict[int, str] = {0: x} if 0 in aux_layers else {}
    residual, pending = x, None  # pending: the last layer's MLP output, not yet added
    presents: list[str] = []
    for i in range(layers):
        p = f"model.layers.{i}."
        normed, residual = input_norm(g, weights, p, residual, pending, hidden, eps)
        if i in aux_layers and i > 0:
            aux_outputs[i] = residual
        qkv = weights.linear(g, normed, [p + f"self_attn.{n}_proj.weight" for n in "qkv"],
                             [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], hidden)
        past_k, past_v = f"past_key_values.{i}.key", f"past_key_values.{i}.value"
        present_k, present_v = f"present.{i}.key", f"present.{i}.value"
        if in_place:
            g.nodes.append(helper.make_node(
                "GroupQueryAttention", [qkv, "", "", past_k, past_v, seqlens, total,
                                        cos_cache, sin_cache], [f"attn{i}/out", present_k, present_v],
                name=f"attn{i}", domain=MS, num_heads=heads, kv_num_heads=kv_heads, scale=float(head_dim ** -0.5),
                do_rotary=1, rotary_interleaved=0))
        else:
            q, k, v = g.node("Split", [qkv,
                                       g.const(f"qkv_split{i}", np.array([heads * head_dim, kv_heads * head_dim,
                                                                          kv_heads * head_dim], np.int64))],
                             n_out=3, axis=-1)
            q = g.one("RotaryEmbedding", [q, "position_ids", cos_cache, sin_cache], domain=MS, interleaved=0,
                      num_heads=heads)
            k = g.one("RotaryEmbedding", [k, "position_ids", cos_cache, sin_cache], domain=MS, interleaved=0,
                      num_heads=kv_heads)
            g.nodes.append(helper.make_node(
                "Attention", [q, k, v, allowed, past_k, past_v], [f"attn{i}/out", present_k, present_v],
                name=f"attn{i}", q_num_heads=heads, kv_num_heads=kv_heads, scale=float(head_dim ** -0.5)))
        presents += [present_k, present_v]
        attn_out = weights.linear(g, f"attn{i}/out", [p + "self_attn.o_proj.weight"], [hidden], heads * head_dim)
        post_w = weights.vector(g, p + "post_attention_layernorm.weight", hidden)
        normed, residual = skip_norm(g, attn_out, residual, post_w, eps)
        gate = weights.linear(g, normed, [p + "mlp.gate_proj.weight"], [inter], hidden)
        up = weights.linear(g, normed, [p + "mlp.up_proj.weight"], [inter], hidden)
        act = g.one("Mul", [g.one("Mul", [gate, g.one("Sigmoid", [gate])]), up])
        pending = weights.linear(g, act, [p + "mlp.down_proj.weight"], [hidden], inter)
    final, residual = skip_norm(g, pending, residual, weights.vector(g, "model.norm.weight", hidden), eps)
    if layers in aux_layers:
        aux_outputs[layers] = residual
    g.nodes.append(helper.make_node("Identity", [final], ["hidden_states"], name="hidden_out"))
    weights.linear(g, final, ["lm_head.weight"], [vocab], hidden, output="logits")
    for j in aux_layers:
        g.nodes.append(helper.make_node("Identity", [aux_outputs[j]], [aux_output_name(j)], name=f"aux_out{j}"))

    return save_decoder(g, out_path, "llama_fused", "specserve.modelbuild.fused_graph", OPSET, in_place, presents,
                        aux_layers, vocab, hidden, kv_heads, head_dim)


def save_decoder(g: _Graph, out_path: Path, graph_name: str, producer: str, opset: int, in_place: bool,
                 presents: list[str], aux_layers: tuple[int, ...], vocab: int, hidden: int, kv_heads: int,
                 head_dim: int, extra_inputs: list[onnx.ValueInfoProto] = ()) -> Path:
    """Declare a decoder graph's engine I/O around ``g``'s nodes and save it: ``input_ids``,
    ``attention_mask``, ``position_ids`` unless ``in_place`` (positions are then slot
    indices), ``past_key_values.*`` and ``extra_inputs`` in; ``logits``, ``presents``,
    ``hidden_states`` and the aux layers' states out."""
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    kv_shape = ["batch", kv_heads, "past_sequence", head_dim]
    inputs = [helper.make_tensor_value_info("input_ids", i64, ["batch", "sequence"]),
              helper.make_tensor_value_info("attention_mask", i64, ["batch", "total_sequence"])]
    if not in_place:
        inputs.append(helper.make_tensor_value_info("position_ids", i64, ["batch", "sequence"]))
    for i in range(len(presents) // 2):
        inputs += [helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", f32, kv_shape) for kind in ("key", "value")]
    inputs += extra_inputs
    logits_length = "logits_sequence" if extra_inputs else "sequence"  # a graph may cut rows (invariant_graph)
    outputs = [helper.make_tensor_value_info("logits", f32, ["batch", logits_length, vocab])]
    present_length = "past_sequence" if in_place else "total_sequence"  # in place: the same buffer
    outputs += [helper.make_tensor_value_info(name, f32, ["batch", kv_heads, present_length, head_dim])
                for name in presents]
    outputs.append(helper.make_tensor_value_info("hidden_states", f32, ["batch", "sequence", hidden]))
    outputs += [helper.make_tensor_value_info(aux_output_name(j), f32, ["batch", "sequence", hidden]) for j in aux_layers]
    graph = helper.make_graph(g.nodes, graph_name, inputs, outputs, g.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)],
                              producer_name=producer)
    model.ir_version = FUSED_IR_VERSION
    onnx.save(model, str(out_path))
    return out_path


def parity(reference: Path, candidate: Path, steps: int = 8) -> float:
    """Max |difference| of every output of two graphs over a prefill, cached single-token
    steps, and a right-padded batch of two with unequal pasts and new-token counts."""
    import onnxruntime as ort

    sessions = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in (reference, candidate)]
    names = [o.name for o in sessions[0].get_outputs()]
    if sorted(names) != sorted(o.name for o in sessions[1].get_outputs()):
        raise RuntimeError(f"{candidate} outputs differ from {reference}'s")
    pasts = [i for i in sessions[0].get_inputs() if i.name.startswith("past_key_values.")]
    vocab = sessions[0].get_outputs()[0].shape[2]
    rng = np.random.default_rng(0)

    def run(ids, mask, positions, past):
        feed = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, **past}
        return [dict(zip(names, s.run(names, feed))) for s in sessions]

    def worst(a: dict, b: dict) -> float:
        return max(float(np.abs(a[n] - b[n]).max()) for n in names)

    empty = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for i in pasts}
    prompt = rng.integers(0, vocab, (1, 40))
    ref, cand = run(prompt, np.ones((1, 40), np.int64), np.arange(40)[None], empty)
    diff = worst(ref, cand)
    past = {i.name: ref[i.name.replace("past_key_values", "present")] for i in pasts}
    for step in range(steps):
        length = 40 + step
        ref, cand = run(rng.integers(0, vocab, (1, 1)), np.ones((1, length + 1), np.int64),
                        np.array([[length]]), past)
        diff = max(diff, worst(ref, cand))
        past = {i.name: ref[i.name.replace("past_key_values", "present")] for i in pasts}
    # Sequence 1 keeps 30 of the 48 past tokens and feeds 2 of 4 new ones, padded right.
    length = 40 + steps
    batch_past = {n: np.concatenate([p, np.pad(p[:, :, :30], ((0, 0), (0, 0), (0, length - 30), (0, 0)))])
                  for n, p in past.items()}
    mask = np.ones((2, length + 4), np.int64)
    mask[1, 30:length] = 0
    mask[1, length + 2:] = 0
    positions = np.stack([np.arange(length, length + 4), 30 + np.minimum(np.arange(4), 1)])
    ref, cand = run(rng.integers(0, vocab, (2, 4)), mask, positions, batch_past)
    for name in names:  # padded rows and slots hold garbage in both graphs: compare real ones
        if name.startswith("present."):
            a, b = ref[name], cand[name]
            real = np.concatenate([a[1:, :, :30], a[1:, :, length:length + 2]], axis=2)
            real_b = np.concatenate([b[1:, :, :30], b[1:, :, length:length + 2]], axis=2)
            diff = max(diff, float(np.abs(a[0] - b[0]).max()), float(np.abs(real - real_b).max()))
        else:
            diff = max(diff, float(np.abs(ref[name][0] - cand[name][0]).max()),
                       float(np.abs(ref[name][1, :2] - cand[name][1, :2]).max()))
    return diff


def in_place_parity(reference: Path, candidate: Path, verifies: int = 6, relative: bool = False) -> float:
    """Max |difference| of every output of the standard graph ``reference`` and its
    in-place graph ``candidate`` (one shared buffer per layer through IO binding) over the
    way one sequence is served: a prefill, then rounds of a 5-token verify rewound to
    between 1 and 4 accepted tokens, each followed by a 1-token step; and of the KV each
    leaves. ``relative``: each output's difference over its largest magnitude (a real
    model's residual stream reaches ~25 000, where float32 rounding alone is ~1e-2)."""
    import onnxruntime as ort

    reference_session = ort.InferenceSession(str(reference), providers=["CPUExecutionProvider"])
    in_place = ort.InferenceSession(str(candidate), providers=["CPUExecutionProvider"])
    names = [o.name for o in reference_session.get_outputs() if not o.name.startswith("present.")]
    pasts = [i for i in reference_session.get_inputs() if i.name.startswith("past_key_values.")]
    vocab = reference_session.get_outputs()[0].shape[2]
    capacity = 96
    buffers = {i.name: ort.OrtValue.ortvalue_from_numpy(np.zeros((1, i.shape[1], capacity, i.shape[3]), np.float32))
               for i in pasts}
    rng = np.random.default_rng(0)
    scale = (lambda value: max(float(np.abs(value).max()), 1.0)) if relative else (lambda value: 1.0)

    def run(ids: np.ndarray, length: int, past: dict) -> tuple[float, dict]:
        feed = {"input_ids": ids, "attention_mask": np.ones((1, length + ids.shape[1]), np.int64),
                "position_ids": np.arange(length, length + ids.shape[1])[None], **past}
        ref = dict(zip([o.name for o in reference_session.get_outputs()], reference_session.run(None, feed)))
        binding = in_place.io_binding()
        binding.bind_cpu_input("input_ids", ids)
        binding.bind_cpu_input("attention_mask", feed["attention_mask"])
        for name in names:
            binding.bind_output(name, "cpu")
        for name, value in buffers.items():
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(name.replace("past_key_values", "present"), value)
        in_place.run_with_iobinding(binding)
        out = dict(zip(names, (v.numpy() for v in binding.get_outputs()[: len(names)])))
        diff = max(float(np.abs(ref[n] - out[n]).max()) / scale(ref[n]) for n in names)
        return diff, {i.name: ref[i.name.replace("past_key_values", "present")] for i in pasts}

    empty = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for i in pasts}
    diff, past = run(rng.integers(0, vocab, (1, 40)), 0, empty)
    length = 40
    for round_ in range(verifies):
        step_diff, past = run(rng.integers(0, vocab, (1, 5)), length, past)
        length += 1 + round_ % 4  # the pending token and the accepted drafts; the rest is rewound
        past = {name: value[:, :, :length].copy() for name, value in past.items()}
        one_diff, past = run(rng.integers(0, vocab, (1, 1)), length, past)
        length += 1
        diff = max(diff, step_diff, one_diff)
    kv = max(float(np.abs(past[name] - buffers[name].numpy()[:, :, :length]).max()) / scale(past[name])
             for name in past)
    return max(diff, kv)


def fuse_in_place(model_dir: Path, aux_layers: tuple[int, ...], tolerance: float = 1e-4) -> float:
    """Replace ``model_dir/model.onnx`` by the fused graph, and write its in-place graph
    (``IN_PLACE_FILE``) beside it, if every output of each agrees within ``tolerance``
    with the graph it stands for; return the largest difference seen."""
    current, candidate = model_dir / "model.onnx", model_dir / "model.fused.onnx"
    build_fused_decoder(model_dir, candidate, aux_layers)
    diff = parity(current, candidate)
    if diff > tolerance:
        candidate.unlink()
        raise RuntimeError(f"fused graph disagrees with {current}: max |diff| = {diff:.2e}")
    candidate.replace(current)
    in_place = build_fused_decoder(model_dir, model_dir / IN_PLACE_FILE, aux_layers, in_place=True)
    in_place_diff = in_place_parity(current, in_place)
    if in_place_diff > tolerance:
        in_place.unlink()
        raise RuntimeError(f"in-place graph disagrees with {current}: max |diff| = {in_place_diff:.2e}")
    return max(diff, in_place_diff)


def main() -> None:
    """Rewrite a bundle model's ``model.onnx`` as the fused graph, and write its in-place
    in-place graph beside it, after checking them against the graph they replace: ``python -m specserve.modelbuild.fused_graph models/fixture/target
    --aux 2 8 13``. Needs only onnx and onnxruntime (no torch, no retraining)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--aux", type=int, nargs="*", default=[],
                        help="layers j whose entering residual stream becomes output aux_hidden.j")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args()
    diff = fuse_in_place(args.model_dir, tuple(args.aux), args.tolerance)
    print(f"{args.model_dir / 'model.onnx'} and {IN_PLACE_FILE}: fused graph and its in-place graph written "
          f"(max |diff| vs the graph it replaced = {diff:.2e})")


if __name__ == "__main__":
    main()
