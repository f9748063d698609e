"""Run an ONNX decoder (target or draft) with an explicit KV past.

The runner learns the model's interface from the graph itself: input/output names
(optimum defaults, or the templates of an onnxruntime-genai ``genai_config.json``), the
number of layers, each layer's KV head count, head dim and dtype, and whether
``position_ids`` exists. It refuses models it cannot serve correctly, with the reason.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import onnxruntime as ort

from specserve.engine.config import Device, SpinPolicy
from specserve.engine.errors import ModelLoadError
from specserve.engine.kv.paged_cache import LayerGeometry
from specserve.engine.model.providers import create_session, session_options

_ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16,
               "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}
Past = Sequence[tuple[np.ndarray, np.ndarray]]
_state = ort.capi.onnxruntime_pybind11_state
_ORT_ERRORS = (_state.InvalidArgument, _state.RuntimeException, _state.Fail)  # what a bad feed raises


@dataclass(frozen=True)
class DecoderInterface:
    """Names of the graph's inputs and outputs, discovered at load time."""

    input_ids: str
    attention_mask: str
    position_ids: str | None
    past_keys: tuple[str, ...]
    past_values: tuple[str, ...]
    logits: str
    present_keys: tuple[str, ...]
    present_values: tuple[str, ...]
    extra_outputs: tuple[str, ...]  # e.g. hidden states consumed by proposer heads
    use_cache_branch: str | None = None  # legacy optimum "merged" models


@dataclass
class DecoderOutput:
    logits: np.ndarray                       # [B, S, V] float32
    presents: list[tuple[np.ndarray, np.ndarray]]  # per layer [B, kv_heads, P+S, head_dim]
    extras: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class NameTemplates:
    input_ids: str = "input_ids"
    attention_mask: str = "attention_mask"
    position_ids: str = "position_ids"
    past_key: str = "past_key_values.%d.key"
    past_value: str = "past_key_values.%d.value"
    logits: str = "logits"
    present_key: str = "present.%d.key"
    present_value: str = "present.%d.value"

    @classmethod
    def from_genai_config(cls, path: Path) -> "NameTemplates":
        decoder = json.loads(path.read_text()).get("model", {}).get("decoder", {})
        inputs, outputs = decoder.get("inputs", {}), decoder.get("outputs", {})
        default = cls()
        return cls(
            input_ids=inputs.get("input_ids", default.input_ids),
            attention_mask=inputs.get("attention_mask", default.attention_mask),
            position_ids=inputs.get("position_ids", default.position_ids),
            past_key=inputs.get("past_key_names", default.past_key),
            past_value=inputs.get("past_value_names", default.past_value),
            logits=outputs.get("logits", default.logits),
            present_key=outputs.get("present_key_names", default.present_key),
            present_value=outputs.get("present_value_names", default.present_value),
        )


def _layer_names(template: str, available: set[str]) -> tuple[str, ...]:
    names = []
    while (template % len(names)) in available:
        names.append(template % len(names))
    return tuple(names)


class OnnxDecoder:
    """One ONNX decoder session plus everything needed to feed it correctly."""

    def __init__(self, model_dir: str | Path, device: Device = "auto", intra_op_threads: int | None = None,
                 onnx_file: str | None = None, thread_spinning: SpinPolicy = "always") -> None:
        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise ModelLoadError(f"model directory not found: {self.model_dir}")
        genai_path = self.model_dir / "genai_config.json"
        templates = NameTemplates.from_genai_config(genai_path) if genai_path.is_file() else NameTemplates()
        if onnx_file is None and genai_path.is_file():
            onnx_file = json.loads(genai_path.read_text()).get("model", {}).get("decoder", {}).get("filename")
        self.onnx_path = self.model_dir / (onnx_file or "model.onnx")
        if not self.onnx_path.is_file():
            raise ModelLoadError(f"ONNX file missing: {self.onnx_path}")
        try:
            self.session = create_session(str(self.onnx_path), device, session_options(intra_op_threads, spinning=thread_spinning))
        except ort.capi.onnxruntime_pybind11_state.Fail as exc:  # e.g. external weights file missing
            raise ModelLoadError(f"onnxruntime cannot load {self.onnx_path}: {exc}") from exc
        self.io = self._discover(templates)
        self.layers, self.kv_dtype = self._kv_geometry()
        self.ids_dtype = _ORT_DTYPES[self._inputs[self.io.input_ids].type]
        self.vocab_size = self._probe_vocab_size()
        self.config = self._read_json("config.json")

    # -- discovery ---------------------------------------------------------------------
    @property
    def _inputs(self) -> dict[str, ort.NodeArg]:
        return {i.name: i for i in self.session.get_inputs()}

    @property
    def _outputs(self) -> dict[str, ort.NodeArg]:
        return {o.name: o for o in self.session.get_outputs()}

    def _discover(self, t: NameTemplates) -> DecoderInterface:
        inputs, outputs = set(self._inputs), set(self._outputs)
        for required in (t.input_ids, t.attention_mask):
            if required not in inputs:
                raise ModelLoadError(f"{self.onnx_path}: required input '{required}' not found (inputs: {sorted(inputs)})")
        if t.logits not in outputs:
            raise ModelLoadError(f"{self.onnx_path}: output '{t.logits}' not found (outputs: {sorted(outputs)})")
        past_keys, past_values = _layer_names(t.past_key, inputs), _layer_names(t.past_value, inputs)
        present_keys, present_values = _layer_names(t.present_key, outputs), _layer_names(t.present_value, outputs)
        if not past_keys or not (len(past_keys) == len(past_values) == len(present_keys) == len(present_values)):
            raise ModelLoadError(
                f"{self.onnx_path}: KV inputs/outputs do not pair up per layer "
                f"({len(past_keys)} '{t.past_key}', {len(past_values)} '{t.past_value}', "
                f"{len(present_keys)} '{t.present_key}', {len(present_values)} '{t.present_value}')")
        known_outputs = {t.logits, *present_keys, *present_values}
        return DecoderInterface(
            input_ids=t.input_ids, attention_mask=t.attention_mask,
            position_ids=t.position_ids if t.position_ids in inputs else None,
            past_keys=past_keys, past_values=past_values, logits=t.logits,
            present_keys=present_keys, present_values=present_values,
            extra_outputs=tuple(o.name for o in self.session.get_outputs() if o.name not in known_outputs),
            use_cache_branch="use_cache_branch" if "use_cache_branch" in inputs else None,
        )

    def _kv_geometry(self) -> tuple[tuple[LayerGeometry, ...], np.dtype]:
        """Each layer's KV head count and head dim, from the graph; an export that declares
        them symbolically (onnxruntime-genai writes ``kv_cache_dim``) gets them from
        ``genai_config.json``, and the load-time probe run then checks them."""
        declared = self._read_json("genai_config.json").get("model", {}).get("decoder", {})
        fallback = {1: declared.get("num_key_value_heads"), 3: declared.get("head_size")}
        layers, dtypes = [], set()
        for key_name, value_name in zip(self.io.past_keys, self.io.past_values):
            dims = []
            for name in (key_name, value_name):
                arg = self._inputs[name]
                dtypes.add(arg.type)
                shape = list(arg.shape)
                if len(shape) != 4:
                    raise ModelLoadError(f"{self.onnx_path}: '{name}' must be [batch, kv_heads, past, head_dim], got {shape}")
                for axis, what in ((1, "num_key_value_heads"), (3, "head_size")):
                    if not isinstance(shape[axis], int):
                        if not isinstance(fallback[axis], int):
                            raise ModelLoadError(
                                f"{self.onnx_path}: '{name}' declares {what} symbolically ({shape[axis]!r}) and no "
                                f"genai_config.json beside it states model.decoder.{what}")
                        shape[axis] = fallback[axis]
                dims.append((shape[1], shape[3]))
            if dims[0] != dims[1]:
                raise ModelLoadError(f"{self.onnx_path}: '{key_name}' and '{value_name}' differ in kv_heads/head_dim "
                                     f"({dims[0]} vs {dims[1]})")
            layers.append(LayerGeometry(num_kv_heads=dims[0][0], head_dim=dims[0][1]))
        if len(dtypes) != 1 or next(iter(dtypes)) not in ("tensor(float)", "tensor(float16)"):
            raise ModelLoadError(f"{self.onnx_path}: KV inputs must share one float dtype, got {sorted(dtypes)}")
        return tuple(layers), np.dtype(_ORT_DTYPES[dtypes.pop()])

    def _probe_vocab_size(self) -> int:
        """Run two tokens through the model: proves it loads and that logits cover every
        position (a last-token-only head cannot verify drafts)."""
        logits_shape = self._outputs[self.io.logits].shape
        if len(logits_shape) == 3 and logits_shape[1] == 1:
            raise ModelLoadError(f"{self.onnx_path}: output '{self.io.logits}' is pruned to the last position "
                                 f"(shape {logits_shape}); speculative verification needs logits for every position")
        try:
            # A past of one token, so the KV geometry is exercised (an empty one may be skipped).
            first = self.forward(np.zeros((1, 1), np.int64), np.ones((1, 1), np.int64), np.zeros((1, 1), np.int64),
                                 self.empty_past())
            for (key, value), geometry in zip(first.presents, self.layers):
                if key.shape[1] != geometry.num_kv_heads or key.shape[3] != geometry.head_dim:
                    raise ModelLoadError(f"{self.onnx_path}: the graph returns KV of {key.shape[1]} heads x "
                                         f"{key.shape[3]} dims, but {geometry} was declared")
            out = self.forward(np.zeros((1, 2), np.int64), np.ones((1, 3), np.int64), np.arange(1, 3)[None],
                               first.presents)
        except _ORT_ERRORS as exc:
            raise ModelLoadError(f"{self.onnx_path}: the first run failed ({exc}); if its KV sizes came from "
                                 "genai_config.json, they may not match the graph") from exc
        if out.logits.shape[1] != 2:
            raise ModelLoadError(f"{self.onnx_path}: '{self.io.logits}' returned {out.logits.shape[1]} positions for 2 "
                                 "input tokens: logits are pruned to the last position, which cannot verify drafts")
        return int(out.logits.shape[2])

    def _read_json(self, name: str) -> dict:
        path = self.model_dir / name
        return json.loads(path.read_text()) if path.is_file() else {}

    # -- facts callers need --------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def max_context(self) -> int | None:
        """Context limit from config.json (or genai_config.json), if the model states one."""
        genai = self._read_json("genai_config.json").get("model", {})
        return self.config.get("max_position_embeddings") or genai.get("context_length")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return configured_eos_token_ids(self.model_dir)

    def empty_past(self, batch: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
        return [(np.zeros((batch, g.num_kv_heads, 0, g.head_dim), self.kv_dtype),) * 2 for g in self.layers]

    # -- running --------------------------------------------------------------------------
    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                past: Past) -> DecoderOutput:
        """One call: ``input_ids [B, S]`` (S >= 1), ``attention_mask [B, P+S]``,
        ``position_ids [B, S]``, per-layer past ``[B, kv_heads, P, head_dim]``."""
        if input_ids.ndim != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [batch, new_tokens>=1], got shape {input_ids.shape}")
        if len(past) != self.num_layers:
            raise ValueError(f"expected past for {self.num_layers} layers, got {len(past)}")
        feed: dict[str, np.ndarray] = {
            self.io.input_ids: np.ascontiguousarray(input_ids, dtype=self.ids_dtype),
            self.io.attention_mask: np.ascontiguousarray(attention_mask, dtype=np.int64),
        }
        if self.io.position_ids:
            feed[self.io.position_ids] = np.ascontiguousarray(position_ids, dtype=np.int64)
        if self.io.use_cache_branch:
            feed[self.io.use_cache_branch] = np.array([past[0][0].shape[2] > 0])
        for (key, value), key_name, value_name in zip(past, self.io.past_keys, self.io.past_values):
            feed[key_name], feed[value_name] = key, value
        names = [self.io.logits, *self.io.present_keys, *self.io.present_values, *self.io.extra_outputs]
        results = self.session.run(names, feed)
        n = self.num_layers
        return DecoderOutput(
            logits=results[0].astype(np.float32, copy=False),
            presents=list(zip(results[1 : 1 + n], results[1 + n : 1 + 2 * n])),
            extras=dict(zip(self.io.extra_outputs, results[1 + 2 * n :])),
        )


def configured_eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    """The end-of-sequence ids a model directory's config.json (or genai_config.json)
    names; read without loading the model, by whoever needs them beside it."""
    def read(name: str) -> dict:
        path = Path(model_dir) / name
        return json.loads(path.read_text()) if path.is_file() else {}

    eos = read("config.json").get("eos_token_id", read("genai_config.json").get("model", {}).get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
