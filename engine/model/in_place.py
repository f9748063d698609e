"""Calls at batch 1 on the decoder's in-place twin: one preallocated KV buffer per
sequence, past and present at once.

The standard graph's attention returns ``present = past ++ new``: every call allocates
each layer's whole past again and copies it, and a rewind leaves dead slots that later
calls still carry. Its twin (``model.inplace.onnx``, written by
``modelbuild.fused_graph``) runs ``GroupQueryAttention`` on a buffer of ``capacity``
slots per layer that is bound through IO binding as both the past input and the present
output, so the call writes only its new tokens' KV, at slot ``length``, and a rewind is a
shorter ``length`` -- what onnxruntime-genai does with ``past_present_share_buffer``.
It saves the copies at 1 and 5 new tokens alike (docs/benchmarks/ measures the saving).

Batch 1 only (``GroupQueryAttention`` refuses several new tokens after a past at batch
> 1), positions equal to slot indices (no sliding window), and CPU only: the buffers are
numpy arrays that the paged cache reads as views; on CUDA they would have to live on the
device, which this cache cannot read.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from engine.model.onnx_model import _ORT_DTYPES, OnnxDecoder
from engine.model.providers import session_options

IN_PLACE_FILE = "model.inplace.onnx"  # written beside model.onnx by modelbuild.fused_graph
CAPACITY_STEP = 64                    # buffers grow in whole steps of this many slots
CHECK_TOLERANCE = 1e-3                # load-time agreement with the standard graph (logits)
log = logging.getLogger("specserve.engine")


@dataclass(eq=False)
class KVBuffer:
    """One sequence's past for the twin: per layer ``[1, kv_heads, capacity, head_dim]``,
    slots ``[0, length)`` real (the cache knows ``length``); the same memory is bound as
    the session's past and present, so runs write into it."""

    keys: list[np.ndarray]
    values: list[np.ndarray]
    binding: ort.IOBinding
    _ort_values: list[ort.OrtValue]  # must outlive the binding that points at their memory
    mask: np.ndarray  # [1, capacity] ones: each run binds a prefix of it as its attention mask
    # New-token count -> the input_ids array a run of that width writes its tokens into
    # (onnxruntime reads the bound memory) and its preallocated outputs (arrays and the
    # OrtValues over them): bound when the width changes, so no call allocates them.
    widths: dict[int, tuple[np.ndarray, list[tuple[np.ndarray, ort.OrtValue]]]] = field(default_factory=dict)
    bound_width: int = 0  # the new-token count whose arrays are bound now (bindings persist across runs)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]


def buffer_capacity(needed: int, limit: int) -> int:
    """Slots for a buffer that must hold ``needed``: a quarter more (at least a step), in
    whole steps, at most ``limit`` (the context) unless ``needed`` itself is more."""
    grown = -(-(needed + max(CAPACITY_STEP, needed // 4)) // CAPACITY_STEP) * CAPACITY_STEP
    return max(needed, min(grown, limit))


class InPlaceDecoder:
    """The twin's session, and buffers bound to it."""

    def __init__(self, standard: OnnxDecoder, path: Path, intra_op_threads: int | None,
                 thread_spinning: bool) -> None:
        self.standard = standard
        options = session_options(intra_op_threads, spinning=thread_spinning)
        if thread_spinning:
            # Spin within a run, never after it: the standard session's pool, which serves the
            # batched calls in between, would otherwise find this one's threads spinning on
            # its cores; a batch-1 loop loses next to nothing by it (docs/design-decisions.md).
            options.add_session_config_entry("session.force_spinning_stop", "1")
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        io = standard.io
        self.past_names = list(io.past_keys + io.past_values)
        self.present_names = list(io.present_keys + io.present_values)
        self.output_names = [io.logits, *io.extra_outputs]
        declared = {o.name: o for o in self.session.get_outputs()}
        # [1, S, width] each, in the dtype the graph declares
        self.output_shapes = [(declared[name].shape[-1], _ORT_DTYPES[declared[name].type])
                              for name in self.output_names]
        self.calls = 0  # runs so far (tests check that the path is taken)

    @classmethod
    def load(cls, standard: OnnxDecoder, intra_op_threads: int | None, thread_spinning: bool
             ) -> "InPlaceDecoder | None":
        """The twin beside ``standard``'s graph, or None where there is none or it cannot
        serve: not on CPU, a graph that derives positions from the mask, names or outputs
        that differ, or a first run that disagrees with the standard graph (a stale twin;
        the standard graph then serves every call, which is slower, never wrong)."""
        path = standard.model_dir / IN_PLACE_FILE
        if not path.is_file():
            return None
        if standard.session.get_providers()[0] != "CPUExecutionProvider" or standard.io.position_ids is None:
            log.info("%s not used: the in-place twin serves CPU sessions of graphs with position_ids", path)
            return None
        try:
            twin = cls(standard, path, intra_op_threads, thread_spinning)
        except (ort.capi.onnxruntime_pybind11_state.Fail, ort.capi.onnxruntime_pybind11_state.InvalidGraph,
                ort.capi.onnxruntime_pybind11_state.InvalidProtobuf, KeyError) as exc:
            log.warning("%s not used: onnxruntime cannot load it or it lacks %s's outputs (%s)", path,
                        standard.onnx_path, exc)
            return None
        inputs = {i.name for i in twin.session.get_inputs()}
        outputs = {o.name for o in twin.session.get_outputs()}
        expected_in = {standard.io.input_ids, standard.io.attention_mask, *twin.past_names}
        if inputs != expected_in or outputs != set(twin.output_names) | set(twin.present_names):
            log.warning("%s not used: its inputs/outputs differ from %s's", path, standard.onnx_path)
            return None
        difference = twin.agreement()
        if difference > CHECK_TOLERANCE:
            log.warning("%s not used: its logits differ from %s's by %.2e (a stale twin? rebuild it with "
                        "python -m modelbuild.fused_graph)", path, standard.onnx_path, difference)
            return None
        return twin

    def agreement(self) -> float:
        """Max |logit difference| from the standard graph over a 3-token prefill and a
        2-token step after it (checked once, at load)."""
        ids = np.array([[1, 2, 3, 4, 5]], np.int64)
        reference = self.standard.forward(ids, np.ones((1, 5), np.int64), np.arange(5)[None],
                                          self.standard.empty_past()).logits
        buffer = self.new_buffer(8)
        first, _ = self.run(buffer, 0, ids[:, :3])
        second, _ = self.run(buffer, 3, ids[:, 3:])
        return float(np.abs(np.concatenate([first, second], axis=1) - reference).max())

    def new_buffer(self, capacity: int) -> KVBuffer:
        """Zeroed buffers, bound once as past and present of every layer (zeros: a slot
        past ``length`` is never read, but garbage there could be NaN)."""
        keys, values, ort_values = [], [], []
        binding = self.session.io_binding()
        dtype = self.standard.kv_dtype
        for geometry in self.standard.layers:
            shape = (1, geometry.num_kv_heads, capacity, geometry.head_dim)
            keys.append(np.zeros(shape, dtype))
            values.append(np.zeros(shape, dtype))
        for array, past, present in zip(keys + values, self.past_names, self.present_names):
            value = ort.OrtValue.ortvalue_from_numpy(array)  # wraps the array's memory, no copy
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
            ort_values.append(value)
        return KVBuffer(keys, values, binding, ort_values, np.ones((1, capacity), np.int64))

    def run(self, buffer: KVBuffer, length: int, input_ids: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Run ``input_ids [1, S]`` after the buffer's first ``length`` slots; their KV is
        written to slots ``[length, length + S)``. Returns logits ``[1, S, V]`` and the
        extra outputs by name."""
        new = input_ids.shape[1]
        if length + new > buffer.capacity:
            raise ValueError(f"{length} + {new} tokens do not fit a buffer of {buffer.capacity} slots")
        binding = buffer.binding
        arrays = buffer.widths.get(new)
        if arrays is None:
            outputs = [np.empty((1, new, width), dtype) for width, dtype in self.output_shapes]
            arrays = buffer.widths[new] = (np.empty((1, new), self.standard.ids_dtype),
                                           [(a, ort.OrtValue.ortvalue_from_numpy(a)) for a in outputs])
        ids, outputs = arrays
        ids[:] = input_ids
        if buffer.bound_width != new:
            binding.bind_cpu_input(self.standard.io.input_ids, ids)
            for name, (_, value) in zip(self.output_names, outputs):
                binding.bind_ortvalue_output(name, value)
            buffer.bound_width = new
        binding.bind_cpu_input(self.standard.io.attention_mask, buffer.mask[:, : length + new])
        self.session.run_with_iobinding(binding)
        self.calls += 1
        # Copies: the arrays are this buffer's, rewritten by its next call of this width.
        logits = outputs[0][0].astype(np.float32)
        return logits, {name: array.copy() for name, (array, _) in zip(self.output_names[1:], outputs[1:])}
