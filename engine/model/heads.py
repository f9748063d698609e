"""Loading proposer heads: their ONNX sessions, their configs, and the target arrays
(embedding table, LM head) they need outside their graphs (``LinearEmbedder`` /
``LinearLmHead``, named after ``speculative.rs``'s)."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specserve.engine.config import Device
from specserve.engine.errors import ModelLoadError
from specserve.engine.kv.paged_cache import LayerGeometry
from specserve.engine.model.probe import probe_session
from specserve.engine.model.providers import create_session, session_options

log = logging.getLogger("specserve.engine")
INT8_FILE = "model.int8.onnx"  # a head's int8 graph, beside model.onnx (``modelbuild.int8_graph``)
_logged_graphs: set[tuple[str, str]] = set()


class TokenEmbedder:
    """Rows of the target's input-embedding table ``[V, H]``."""

    def __init__(self, table: np.ndarray) -> None:
        if table.ndim != 2:
            raise ModelLoadError(f"embedding table must be [vocab, hidden], got shape {table.shape}")
        self.table = np.ascontiguousarray(table, dtype=np.float32)

    @property
    def hidden_size(self) -> int:
        return self.table.shape[1]

    def embed(self, tokens) -> np.ndarray:
        return self.table[np.asarray(tokens, dtype=np.int64)]


# logits = MatMul(hidden [B, H], weight [H, V]), opset 17, IR 9: the bytes onnx.helper
# writes for that one-node graph (tests/test_proposers.py rebuilds them and compares).
# onnx is not a runtime dependency; onnxruntime builds a session from bytes.
MATMUL_GRAPH = (
    b'\x08\t\x12\tspecserve:\xa3\x01\n \n\x06hidden\n\x06weight\x12\x06logits"\x06MatMul\x12\x07lm_head'
    b'Z(\n\x06hidden\x12\x1e\n\x1c\x08\x01\x12\x18\n\x07\x12\x05batch\n\r\x12\x0bhidden_size'
    b'Z(\n\x06weight\x12\x1e\n\x1c\x08\x01\x12\x18\n\r\x12\x0bhidden_size\n\x07\x12\x05vocab'
    b'b"\n\x06logits\x12\x18\n\x16\x08\x01\x12\x12\n\x07\x12\x05batch\n\x07\x12\x05vocabB\x04\n\x00\x10\x11')


class LinearLmHead:
    """The target's LM head ``[V, H]``: logits = hidden @ W.T."""

    def __init__(self, weight: np.ndarray) -> None:
        if weight.ndim != 2:
            raise ModelLoadError(f"LM head must be [vocab, hidden], got shape {weight.shape}")
        self.weight_t = np.ascontiguousarray(weight.T, dtype=np.float32)
        # onnxruntime's MatMul on the calling thread (one thread: no pool to wake or to
        # fight the target's). It is faster than numpy's einsum, whose loop is not BLAS, and
        # numpy's BLAS matmul wakes OpenBLAS's thread pool, whose spinning threads slow the
        # target's runs down (docs/design-decisions.md).
        self._session = ort.InferenceSession(MATMUL_GRAPH, session_options(1, spinning="never"),
                                             providers=["CPUExecutionProvider"])

    @property
    def vocab_size(self) -> int:
        return self.weight_t.shape[1]

    @property
    def hidden_size(self) -> int:
        return self.weight_t.shape[0]

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """``[H] -> [V]``, or ``[..., H] -> [..., V]``."""
        hidden = np.asarray(hidden, np.float32)
        rows = np.ascontiguousarray(hidden.reshape(-1, self.hidden_size))
        out = self._session.run(None, {"hidden": rows, "weight": self.weight_t})[0]
        return out.reshape(*hidden.shape[:-1], self.vocab_size)


@dataclass
class HeadModel:
    """One head's session plus what its config says about wiring it to the target."""

    kind: str
    directory: Path
    config: dict
    graph: Path  # the graph file the session runs: model.onnx, or its int8 graph
    session: object
    embedder: TokenEmbedder
    lm_head: LinearLmHead | None
    d2t: np.ndarray | None

    @property
    def hidden_size(self) -> int:
        return self.embedder.hidden_size

    @cached_property
    def draft_vocabulary(self) -> np.ndarray | None:
        """The target id of each draft id with a reduced draft vocabulary (a grammar's mask,
        over the target's vocabulary, is read through it); None when the two are the same."""
        return None if self.d2t is None else np.arange(len(self.d2t)) + self.d2t

    def target_ids(self, draft_ids) -> list[int]:
        """Draft ids to target ids: ``i + d2t[i]`` with a reduced draft vocabulary, else the same."""
        ids = np.asarray(draft_ids, np.int64)
        return (ids if self.d2t is None else ids + self.d2t[ids]).tolist()

    def input_shape(self, name: str) -> list:
        for arg in self.session.get_inputs():
            if arg.name == name:
                return arg.shape
        raise ModelLoadError(f"{self.directory}: head has no input '{name}'")

    def probe(self) -> None:
        probe_session(self.session, f"{self.kind} head {self.directory}")

    def past_geometry(self) -> LayerGeometry:
        shape = self.input_shape("past_key_values.0.key")
        return LayerGeometry(num_kv_heads=int(shape[1]), head_dim=int(shape[3]))


_REQUIRED_INPUTS = {
    "mtp": {"inputs_embeds", "hidden_states", "attention_mask", "position_ids",
            "past_key_values.0.key", "past_key_values.0.value"},
    "eagle3": {"inputs_embeds", "fused_hidden", "recycled_hidden", "attention_mask", "position_ids",
               "past_key_values.0.key", "past_key_values.0.value"},
    "shared_kv": {"inputs_embeds", "position_ids", "attention_mask"},
}


def load_head(kind: str, head_dir: str | Path, target_vocab: int, target_hidden: int, device: Device = "auto",
              intra_op_threads: int | None = None, int8: bool = True) -> HeadModel:
    """Load a head and check it against the target it will serve (hidden size, vocab).
    ``int8``: on CPU, run the head's int8 graph (``INT8_FILE``) where the directory has one."""
    head_dir = Path(head_dir)
    config_path, onnx_path = head_dir / "config.json", head_dir / "model.onnx"
    for path in (config_path, onnx_path):
        if not path.is_file():
            raise ModelLoadError(f"{kind} head: missing {path}")
    config = json.loads(config_path.read_text())
    if config.get("head_type") != kind:
        raise ModelLoadError(f"{config_path} describes a '{config.get('head_type')}' head, not '{kind}'")
    session, graph = _head_session(head_dir, onnx_path, device, session_options(intra_op_threads), int8)
    _log_graph(kind, graph)
    inputs = {i.name for i in session.get_inputs()}
    missing = _REQUIRED_INPUTS[kind] - inputs
    if missing:
        raise ModelLoadError(f"{onnx_path}: {kind} head lacks inputs {sorted(missing)}")
    target_dir = (head_dir / config.get("target", "../../target")).resolve()
    embedder = TokenEmbedder(_load_array(target_dir / "embed_tokens.npy"))
    if embedder.table.shape != (target_vocab, target_hidden):
        raise ModelLoadError(f"{target_dir}/embed_tokens.npy has shape {embedder.table.shape}, "
                             f"the target needs ({target_vocab}, {target_hidden})")
    d2t = None
    if config.get("d2t"):
        d2t = _load_array(head_dir / config["d2t"]).astype(np.int64)
        mapped = np.arange(len(d2t)) + d2t
        if mapped.min() < 0 or mapped.max() >= target_vocab:
            raise ModelLoadError(f"{head_dir}/{config['d2t']} maps draft ids outside the target vocabulary")
    lm_head = None
    if kind == "mtp":
        weight = _load_array(target_dir / "lm_head.npy")
        if weight.shape != (target_vocab, target_hidden):
            raise ModelLoadError(f"{target_dir}/lm_head.npy is {weight.shape[0]}x{weight.shape[1]}, "
                                 f"the target needs {target_vocab}x{target_hidden}")
        # A draft vocabulary keeps only its rows of the target's LM head: a full 49152-row
        # product costs 6.2 ms a draft step on this CPU, 8192 rows a sixth of it (docs/models.md).
        lm_head = LinearLmHead(weight if d2t is None else weight[np.arange(len(d2t)) + d2t])
    head = HeadModel(kind, head_dir, config, graph, session, embedder, lm_head, d2t)
    hidden_input = "hidden_states" if kind == "mtp" else ("recycled_hidden" if kind == "eagle3" else None)
    if hidden_input and head.input_shape(hidden_input)[-1] != target_hidden:
        raise ModelLoadError(f"{onnx_path}: {kind} head hidden size {head.input_shape(hidden_input)[-1]} does not "
                             f"match the target's {target_hidden}")
    return head


def _head_session(head_dir: Path, onnx_path: Path, device: Device, options: ort.SessionOptions,
                  int8: bool) -> tuple[ort.InferenceSession, Path]:
    """The head's session and the graph it runs. The int8 graph is a CPU measure (a head's
    step there is the time to read its weights, and a draft only has to be a good guess:
    the target verifies it); where CUDA loads, the float graph runs."""
    int8_path = head_dir / INT8_FILE
    if int8 and int8_path.is_file():
        try:
            session = create_session(str(int8_path), device, options)
        except Exception as error:  # a damaged int8 graph, or an onnxruntime without its kernels
            log.warning("%s: not used (%s); the head runs %s", int8_path, error, onnx_path.name)
        else:
            if "CUDAExecutionProvider" not in session.get_providers():
                return session, int8_path
    return create_session(str(onnx_path), device, options), onnx_path


def _log_graph(kind: str, graph: Path) -> None:
    if (kind, graph.name) not in _logged_graphs:
        _logged_graphs.add((kind, graph.name))
        log.info("%s head runs %s", kind, graph.name)


def _load_array(path: Path) -> np.ndarray:
    if not path.is_file():
        raise ModelLoadError(f"array missing: {path}")
    return np.load(path)
