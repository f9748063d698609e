"""Calls at batch 1 on the decoder's in-place graph: one preallocated KV buffer per
sequence, past and present at once.

The standard graph's attention returns ``present = past ++ new``: every call allocates
each layer's whole past again and copies it, and a rewind leaves dead slots that later
calls still carry. Its in-place graph (``model.inplace.onnx``, written by
``modelbuild.fused_graph``) runs ``GroupQueryAttention`` on a buffer of ``capacity``
slots per layer that is bound through IO binding as both the past input and the present
output, so the call writes only its new tokens' KV, at slot ``length``, and a rewind is a
shorter ``length`` -- what onnxruntime-genai does with ``past_present_share_buffer``.
It saves the copies at 1 and 5 new tokens alike (docs/benchmarks/ measures the saving).

A bundle may carry a step graph for single-token calls (``model.inplace.step.onnx``)
on weights that are faster there: a converted GGUF's Q4_1 blocks run a decode step in
0.7x float32's time and every multi-token call slower (``docs/models.md``). It reads and
writes the same buffers, so a sequence's calls alternate between the two freely.

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

from specserve.engine.model.onnx_model import _ORT_DTYPES, OnnxDecoder
from specserve.engine.model.providers import session_options

IN_PLACE_FILE = "model.inplace.onnx"  # written beside model.onnx by modelbuild.fused_graph
STEP_FILE = "model.inplace.step.onnx"  # optional: the step graph of single-token calls (modelbuild.from_gguf)
LOGITS_FROM = "logits_from"            # optional input [1]: logits of new tokens from this one on (a prefill: the last)
CAPACITY_STEP = 64                    # buffers grow in whole steps of this many slots
CHECK_TOLERANCE = 1e-3                # load-time agreement with the standard graph (logits)
log = logging.getLogger("specserve.engine")


@dataclass(eq=False)
class KVBuffer:
    """One sequence's past for the in-place graph: per layer ``[1, kv_heads, capacity, head_dim]``,
    slots ``[0, length)`` real (the cache knows ``length``); the same memory is bound as
    the session's past and present, so runs write into it. The arrays may be one row of a
    batch's buffer (``engine.model.row_buffers``): they are views then, and the binding
    is made at the first batch-1 run."""

    keys: list[np.ndarray]
    values: list[np.ndarray]
    mask: np.ndarray  # [1, capacity] ones: each run binds a prefix of it as its attention mask
    binding: ort.IOBinding | None = None  # bound at the first run on this buffer
    _ort_values: list[ort.OrtValue] = field(default_factory=list)  # must outlive the binding over their memory
    # (New-token count, first logits row) -> the input_ids array a run of that width writes
    # its tokens into (onnxruntime reads the bound memory), its preallocated outputs (arrays
    # and the OrtValues over them) and its LOGITS_FROM value: bound when the key changes, so
    # no call allocates them.
    widths: dict[tuple[int, int], tuple[np.ndarray, list[tuple[np.ndarray, ort.OrtValue]], np.ndarray]] = field(
        default_factory=dict)
    bound_width: tuple[int, int] = (0, 0)  # the key whose arrays are bound now (bindings persist across runs)
    step_binding: ort.IOBinding | None = None  # the step graph's, bound at its first run

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]


def buffer_capacity(needed: int, limit: int) -> int:
    """Slots for a buffer that must hold ``needed``: a quarter more (at least a step), in
    whole steps, at most ``limit`` (the context) unless ``needed`` itself is more."""
    grown = -(-(needed + max(CAPACITY_STEP, needed // 4)) // CAPACITY_STEP) * CAPACITY_STEP
    return max(needed, min(grown, limit))


class InPlaceDecoder:
    """The in-place graph's session, and buffers bound to it."""

    def __init__(self, standard: OnnxDecoder, path: Path, intra_op_threads: int | None,
                 thread_spinning: bool, batched: bool = False) -> None:
        self.standard = standard
        self.path = path
        # Whether the graph also serves batches (a row-invariant family's, one buffer row per
        # sequence: ``engine.model.row_buffers``), not batch 1 only.
        self.batched = batched
        self.session = self._session(path, intra_op_threads, thread_spinning)
        self.step_session: ort.InferenceSession | None = None  # single-token calls, where there is a step graph
        io = standard.io
        self.past_names = list(io.past_keys + io.past_values)
        self.present_names = list(io.present_keys + io.present_values)
        self.output_names = [io.logits, *io.extra_outputs]
        # Whether the graph computes logits only from LOGITS_FROM on (the fast family's).
        self.cuts_logits = LOGITS_FROM in {i.name for i in self.session.get_inputs()}
        self._all_logits = np.zeros(1, np.int64)  # LOGITS_FROM of batched runs: every row
        declared = {o.name: o for o in self.session.get_outputs()}
        # [1, S, width] each, in the dtype the graph declares
        self.output_shapes = [(declared[name].shape[-1], _ORT_DTYPES[declared[name].type])
                              for name in self.output_names]
        self.calls = 0  # runs so far (tests check that the path is taken)

    @staticmethod
    def _session(path: Path, intra_op_threads: int | None, thread_spinning: bool) -> ort.InferenceSession:
        # Spin within a run, never after it: the standard session's pool, which serves the
        # batched calls in between, would otherwise find this one's threads spinning on
        # its cores; a batch-1 loop loses next to nothing by it (docs/design-decisions.md).
        options = session_options(intra_op_threads, spinning="within_run" if thread_spinning else "never")
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    @classmethod
    def load(cls, standard: OnnxDecoder, intra_op_threads: int | None, thread_spinning: bool,
             path: Path | None = None, step_path: Path | None = None, batched: bool = False
             ) -> "InPlaceDecoder | None":
        """The in-place graph beside ``standard``'s graph (``path``, default ``IN_PLACE_FILE``; the
        step graph ``step_path``, default ``STEP_FILE``), or None where there is
        none or it cannot serve: not on CPU, a graph that derives positions from the mask,
        names or outputs that differ, or a first run that disagrees with the standard
        graph (a stale in-place graph; the standard graph then serves every call, which is slower,
        never wrong). ``batched``: the in-place graph serves batches too (a row-invariant family)."""
        path = path or standard.model_dir / IN_PLACE_FILE
        if not path.is_file():
            return None
        if standard.session.get_providers()[0] != "CPUExecutionProvider" or standard.io.position_ids is None:
            log.info("%s not used: the in-place graph serves CPU sessions of graphs with position_ids", path)
            return None
        try:
            graph = cls(standard, path, intra_op_threads, thread_spinning, batched)
        except (ort.capi.onnxruntime_pybind11_state.Fail, ort.capi.onnxruntime_pybind11_state.InvalidGraph,
                ort.capi.onnxruntime_pybind11_state.InvalidProtobuf, KeyError) as exc:
            log.warning("%s not used: onnxruntime cannot load it or it lacks %s's outputs (%s)", path,
                        standard.onnx_path, exc)
            return None
        inputs = {i.name for i in graph.session.get_inputs()}
        outputs = {o.name for o in graph.session.get_outputs()}
        expected_in = {standard.io.input_ids, standard.io.attention_mask, *graph.past_names,
                       *((LOGITS_FROM,) if graph.cuts_logits else ())}
        if inputs != expected_in or outputs != set(graph.output_names) | set(graph.present_names):
            log.warning("%s not used: its inputs/outputs differ from %s's", path, standard.onnx_path)
            return None
        difference = graph.agreement()
        if difference > CHECK_TOLERANCE:
            log.warning("%s not used: its logits differ from %s's by %.2e (a stale in-place graph? rebuild it with "
                        "python -m specserve.modelbuild.fused_graph)", path, standard.onnx_path, difference)
            return None
        if not batched:
            graph.add_step_graph(step_path or standard.model_dir / STEP_FILE, intra_op_threads, thread_spinning)
        return graph

    def add_step_graph(self, path: Path, intra_op_threads: int | None, thread_spinning: bool) -> None:
        """Serve single-token calls on ``path`` where it exists, loads, has this graph's
        inputs and outputs and agrees with the standard graph; else this graph serves them."""
        if not path.is_file():
            return
        try:
            step = self._session(path, intra_op_threads, thread_spinning)
        except (ort.capi.onnxruntime_pybind11_state.Fail, ort.capi.onnxruntime_pybind11_state.InvalidGraph,
                ort.capi.onnxruntime_pybind11_state.InvalidProtobuf) as exc:
            log.warning("%s not used: onnxruntime cannot load it (%s)", path, exc)
            return
        same_io = ({i.name for i in step.get_inputs()} == {i.name for i in self.session.get_inputs()}
                   and {o.name for o in step.get_outputs()} == {o.name for o in self.session.get_outputs()})
        if not same_io:
            log.warning("%s not used: its inputs/outputs differ from %s's", path, IN_PLACE_FILE)
            return
        self.step_session = step
        difference = self.agreement((3, 1))
        if difference > CHECK_TOLERANCE:
            self.step_session = None
            log.warning("%s not used: its logits differ from %s's by %.2e", path, self.standard.onnx_path, difference)

    def agreement(self, widths: tuple[int, ...] = (3, 2)) -> float:
        """Max |logit difference| from the standard graph over runs of these widths, one
        after another from an empty past (checked once, at load)."""
        ids = np.arange(1, 1 + sum(widths), dtype=np.int64)[None]
        reference = self.standard.forward(ids, np.ones_like(ids), np.arange(ids.shape[1])[None],
                                          self.standard.empty_past()).logits
        buffer, length, runs = self.new_buffer(8), 0, []
        for width in widths:
            runs.append(self.run(buffer, length, ids[:, length : length + width])[0])
            length += width
        return float(np.abs(np.concatenate(runs, axis=1) - reference).max())

    def row_invariance(self) -> float:
        """Max |logit difference| between the same positions computed four ways: one
        token a call, four in one call, and those four in a batch beside another sequence
        (in ``row_buffers``' layout). 0.0 where this machine computes a row from that row
        alone, what a row-invariant family's losslessness rests on (checked once, at load)."""
        vocab = self.standard.vocab_size
        ids = (np.arange(1, 13, dtype=np.int64) * 7919 % vocab)[None]
        other = (np.arange(1, 10, dtype=np.int64) * 104729 % vocab)[None]
        stepped = self.new_buffer(16)
        self.run(stepped, 0, ids[:, :8])
        steps = np.stack([self.run(stepped, 8 + i, ids[:, 8 + i : 9 + i])[0][0, 0] for i in range(4)])  # [4, V]
        wide = self.new_buffer(16)
        self.run(wide, 0, ids[:, :8])
        together = self.run(wide, 8, ids[:, 8:12])[0][0]
        neighbour = self.new_buffer(16)
        self.run(neighbour, 0, other[:, :5])
        keys = [np.concatenate([a[:, :, :16], b[:, :, :16]]) for a, b in zip(stepped.keys, neighbour.keys)]
        values = [np.concatenate([a[:, :, :16], b[:, :, :16]]) for a, b in zip(stepped.values, neighbour.values)]
        binding, _kept = self.bind_rows(keys, values)
        batched = self.run_rows(binding, np.array([8, 5]), np.concatenate([ids[:, 8:12], other[:, 5:9]]))[0][0]
        return float(max(np.abs(steps - together).max(), np.abs(steps - batched).max()))

    def new_buffer(self, capacity: int) -> KVBuffer:
        """Zeroed buffers (zeros: a slot past ``length`` is never read, but garbage there
        could be NaN); bound as past and present at the first run."""
        dtype = self.standard.kv_dtype
        shapes = [(1, g.num_kv_heads, capacity, g.head_dim) for g in self.standard.layers]
        return self.view_buffer([np.zeros(shape, dtype) for shape in shapes], [np.zeros(shape, dtype) for shape in shapes])

    def view_buffer(self, keys: list[np.ndarray], values: list[np.ndarray]) -> KVBuffer:
        """A buffer over given per-layer ``[1, heads, capacity, dim]`` arrays (contiguous:
        a row of a batch's buffer is)."""
        return KVBuffer(keys, values, np.ones((1, keys[0].shape[2]), np.int64))

    def _bind(self, buffer: KVBuffer) -> ort.IOBinding:
        """Bind the buffer's arrays as past and present of every layer (once)."""
        buffer.binding, buffer._ort_values = self.bind_rows(buffer.keys, buffer.values)
        return buffer.binding

    def run_rows(self, binding: ort.IOBinding, lengths: np.ndarray, input_ids: np.ndarray
                 ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """A batched run on a batch buffer bound by ``binding`` (``row_buffers``): row
        ``r``'s new tokens ``input_ids[r]`` after its first ``lengths[r]`` slots, written
        there. Returns logits ``[R, S, V]`` and the extra outputs by name."""
        rows, new = input_ids.shape
        mask = np.zeros((rows, int(lengths.max()) + new), np.int64)
        mask[np.arange(mask.shape[1])[None, :] < (lengths + new)[:, None]] = 1
        binding.bind_cpu_input(self.standard.io.input_ids, np.ascontiguousarray(input_ids, self.standard.ids_dtype))
        binding.bind_cpu_input(self.standard.io.attention_mask, mask)
        if self.cuts_logits:
            binding.bind_cpu_input(LOGITS_FROM, self._all_logits)
        # Fresh arrays each call (the caller keeps them), bound where the session writes.
        outputs = [np.empty((rows, new, width), dtype) for width, dtype in self.output_shapes]
        kept = [ort.OrtValue.ortvalue_from_numpy(array) for array in outputs]
        for name, value in zip(self.output_names, kept):
            binding.bind_ortvalue_output(name, value)
        self.session.run_with_iobinding(binding)
        self.calls += 1
        return outputs[0].astype(np.float32, copy=False), dict(zip(self.output_names[1:], outputs[1:]))

    def bind_rows(self, keys: list[np.ndarray], values: list[np.ndarray]) -> tuple[ort.IOBinding, list[ort.OrtValue]]:
        """A binding of per-layer batch buffers ``[R, heads, capacity, dim]`` as past and
        present, and the OrtValues over their memory (keep them as long as the binding)."""
        binding = self.session.io_binding()
        kept = []
        for array, past, present in zip(keys + values, self.past_names, self.present_names):
            value = ort.OrtValue.ortvalue_from_numpy(array)  # wraps the array's memory, no copy
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
            kept.append(value)
        return binding, kept

    def run(self, buffer: KVBuffer, length: int, input_ids: np.ndarray, logits_from: int = 0
            ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Run ``input_ids [1, S]`` after the buffer's first ``length`` slots; their KV is
        written to slots ``[length, length + S)``. Returns logits ``[1, S - logits_from, V]``
        (the rows of new tokens ``logits_from`` on: a prefill wants its last) and the extra
        outputs ``[1, S, ...]`` by name."""
        new = input_ids.shape[1]
        if length + new > buffer.capacity:
            raise ValueError(f"{length} + {new} tokens do not fit a buffer of {buffer.capacity} slots")
        cut = logits_from if self.cuts_logits else 0  # a graph without the input: cut after it
        key = (new, cut)
        arrays = buffer.widths.get(key)
        if arrays is None:
            outputs = [np.empty((1, new - (cut if i == 0 else 0), width), dtype)
                       for i, (width, dtype) in enumerate(self.output_shapes)]
            arrays = buffer.widths[key] = (np.empty((1, new), self.standard.ids_dtype),
                                           [(a, ort.OrtValue.ortvalue_from_numpy(a)) for a in outputs],
                                           np.array([cut], np.int64))
        ids, outputs, first = arrays
        ids[:] = input_ids
        if new == 1 and self.step_session is not None:
            session, binding = self.step_session, buffer.step_binding or self._bind_step(buffer, ids, outputs)
        else:
            session, binding = self.session, buffer.binding or self._bind(buffer)
            if buffer.bound_width != key:
                self._bind_width(binding, ids, outputs, first if self.cuts_logits else None)
                buffer.bound_width = key
        binding.bind_cpu_input(self.standard.io.attention_mask, buffer.mask[:, : length + new])
        session.run_with_iobinding(binding)
        self.calls += 1
        # Copies: the arrays are this buffer's, rewritten by its next call of this width.
        logits = outputs[0][0][:, logits_from - cut:].astype(np.float32)
        return logits, {name: array.copy() for name, (array, _) in zip(self.output_names[1:], outputs[1:])}

    def _bind_width(self, binding: ort.IOBinding, ids: np.ndarray, outputs: list,
                    logits_from: np.ndarray | None = None) -> None:
        binding.bind_cpu_input(self.standard.io.input_ids, ids)
        if logits_from is not None:
            binding.bind_cpu_input(LOGITS_FROM, logits_from)
        for name, (_, value) in zip(self.output_names, outputs):
            binding.bind_ortvalue_output(name, value)

    def _bind_step(self, buffer: KVBuffer, ids: np.ndarray, outputs: list) -> ort.IOBinding:
        """The step graph's binding of ``buffer``: its past and present are the same
        OrtValues, its input and outputs the buffer's width-1 arrays; bound once."""
        binding = self.step_session.io_binding()
        if not buffer._ort_values:
            self._bind(buffer)
        for value, past, present in zip(buffer._ort_values, self.past_names, self.present_names):
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
        self._bind_width(binding, ids, outputs)
        buffer.step_binding = binding
        return binding
