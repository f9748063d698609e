"""A Llama GGUF -> the target of a specserve bundle, without torch (numpy, ``gguf``,
``onnx``, ``tokenizers``):

- ``target/model.onnx``: ``fused_graph``'s Llama graph (the engine's I/O, the final
  normalised hidden state and the EAGLE-3 aux layers as outputs) on the file's own
  weights (``weights.py``); ``target/model.inplace.onnx``, its in-place graph (batch 1); and
  ``target/model.inplace.step.onnx``, the step graph for single-token calls in the format
  fastest there. All three read one ``model.onnx.data``. The default puts the graph and
  its in-place graph in float32 and the step graph on the file's Q4_1 blocks: exact both ways,
  and each the fastest exact format for its calls (``docs/models.md``). Together they
  are the *exact* format;
- ``target/model.fast.onnx`` and ``target/model.fast.inplace.onnx``: the *fast* format
  (``engine.model.graph_family``), the file's Q4_1 blocks and Q8_0 table computed with
  int8 activations (accuracy level 4) in ``invariant_graph``'s row-invariant graphs,
  which make it lossless at any width and batch;
- ``target/embed_tokens.npy`` (and ``lm_head.npy``: the same file when tied), the float32
  arrays heads use outside their graphs;
- ``target/config.json``, ``tokenizer.json``, ``tokenizer_config.json`` (chat template, EOS);
- ``manifest.json``, recording the GGUF's sha256 and where it came from. Heads and a
  draft model already in the bundle's manifest are kept: re-converting the target into a
  bundle that has trained heads leaves them in place.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

import numpy as np
import onnxruntime as ort

from specserve.engine.model.manifest import (MANIFEST_NAME, ArrayEntry, BundleManifest, ConversionRecord, HiddenOutputs,
                                   ModelEntry)

from ..convert.target import architecture_of, default_aux_layers
from specserve.engine.model.in_place import STEP_FILE

from specserve.engine.model.graph_family import FAST_FILE, FAST_IN_PLACE_FILE

from ..fused_graph import IN_PLACE_FILE, build_fused_decoder, in_place_parity
from ..invariant_graph import build_invariant_decoder
from ..weights_file import aux_output_name
from .checkpoint import GgufCheckpoint, sha256_of
from .tokenizer import write_tokenizer
from .weights import DATA_FILE, ExternalData, GgufWeights

FINAL_HIDDEN = "hidden_states"
FAST_WEIGHTS = "q4_1"  # the file's own blocks; its Q8_0 table as 8-bit MatMulNBits
# Raised whenever the fast graphs change, so that an installed bundle converted by an
# older builder is converted again (``modelbuild.default_model.is_current`` reads the notes).
FAST_REVISION = 3
# The step graph's LM head: the Q8_0 table on int8 activations, x refined over three rows
# (two passes over 28 MB instead of one over float32's 113 MB), as close to float32 as the
# float32 head is (docs/models.md, the exact step's head).
STEP_HEAD_ROWS = 3
IN_PLACE_TOLERANCE = 1e-4  # relative; float32 rounding of the two attention ops measures ~4e-6 on SmolLM2


def tool_version() -> str:
    from importlib.metadata import version

    return f"specserve modelbuild.from_gguf (gguf {version('gguf')}, onnx {version('onnx')})"


def convert_gguf(gguf_path: Path, out: Path, weight_format: str = "fp32", accuracy_level: int = 0,
                 step_format: str | None = "q4_1", source: str | None = None, name: str | None = None,
                 aux_layers: tuple[int, ...] | None = None, fast: bool = True,
                 progress: Callable[[str], None] = print) -> BundleManifest:
    """Write the target of bundle ``out`` from ``gguf_path``; returns the manifest saved.
    ``weight_format`` serves every call of the exact format, except single-token calls
    at batch 1 when ``step_format`` names another (None: no step graph);
    ``fast`` adds the fast format's graphs."""
    started = time.perf_counter()
    step = lambda what: progress(f"[{time.perf_counter() - started:5.1f} s] {what}")  # noqa: E731
    step(f"reading {gguf_path}")
    checkpoint = GgufCheckpoint(gguf_path)
    digest = sha256_of(gguf_path)
    config = checkpoint.config()
    architecture = architecture_of(config)
    aux = tuple(aux_layers) if aux_layers is not None else default_aux_layers(architecture.num_layers)
    target = out / "target"
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer(checkpoint, target, architecture.max_position_embeddings)

    step_format = None if step_format == weight_format else step_format
    store = ExternalData(target / DATA_FILE)
    weights = GgufWeights(checkpoint, store, weight_format, accuracy_level)
    for stale in (STEP_FILE, FAST_FILE, FAST_IN_PLACE_FILE):
        (target / stale).unlink(missing_ok=True)
    try:
        step(f"writing the {weight_format} graph")
        build_fused_decoder(target, target / "model.onnx", aux, weights=weights)
        step("writing its in-place graph (batch 1)")
        build_fused_decoder(target, target / IN_PLACE_FILE, aux, in_place=True, weights=weights)
        if step_format:
            step(f"writing the step graph in {step_format}")
            build_fused_decoder(target, target / STEP_FILE, aux, in_place=True,
                                weights=GgufWeights(checkpoint, store, step_format, head_rows=STEP_HEAD_ROWS))
        if fast and (config.get("model_type") != "llama" or config.get("rope_scaling")):
            step("no fast format: its row-invariant graph is written for plain Llama (no rope scaling) only")
            fast = False
        if fast:
            fast_weights = GgufWeights(checkpoint, store, FAST_WEIGHTS, accuracy_level=4)
            step(f"writing the fast format ({FAST_WEIGHTS}, int8 activations, row-invariant)")
            build_invariant_decoder(target, target / FAST_FILE, aux, in_place=False, weights=fast_weights)
            build_invariant_decoder(target, target / FAST_IN_PLACE_FILE, aux, in_place=True, weights=fast_weights)
            for graph in (FAST_FILE, FAST_IN_PLACE_FILE):  # every node's inputs exist, its types agree
                step(f"checking {graph} loads")
                ort.InferenceSession(str(target / graph), providers=["CPUExecutionProvider"])
    finally:
        store.close()
    if weight_format != "int8" and accuracy_level == 0:  # int8 activations round differently in each graph
        for graph_file in (IN_PLACE_FILE, STEP_FILE if step_format else None):
            if graph_file:
                step(f"checking {graph_file} against the graph")
                difference = in_place_parity(target / "model.onnx", target / graph_file, verifies=2, relative=True)
                if difference > IN_PLACE_TOLERANCE:
                    raise RuntimeError(f"{graph_file} disagrees with the graph by {difference:.2e} (relative)")

    step("writing the embedding and LM-head arrays")
    np.save(target / "embed_tokens.npy", checkpoint.tensor("model.embed_tokens.weight").dequantize())
    lm_head = target / "lm_head.npy"
    lm_head.unlink(missing_ok=True)
    if config["tie_word_embeddings"]:
        os.link(target / "embed_tokens.npy", lm_head)  # one file on disk
    else:
        np.save(lm_head, checkpoint.tensor("lm_head.weight").dequantize())

    record = ConversionRecord(
        source=source or gguf_path.name, source_format=f"gguf ({'+'.join(sorted(checkpoint.encodings()))})",
        tool=tool_version(), sha256=digest,
        notes=served_as(weight_format, accuracy_level, step_format, fast))
    manifest = _manifest(out, config, architecture, aux, record, checkpoint, name)
    manifest.save(out)
    step(f"done: {out}")
    return manifest


def served_as(weight_format: str, accuracy_level: int = 0, step_format: str | None = "q4_1",
              fast: bool = True) -> str:
    """The manifest's record of the formats (``ConversionRecord.notes``)."""
    level = f", accuracy_level {accuracy_level}" if accuracy_level else ""
    steps = (f"; single-token calls at batch 1 as {step_format}, LM head on int8 activations over {STEP_HEAD_ROWS} rows"
             if step_format and step_format != weight_format else "")
    fast_format = (f"; fast format: {FAST_WEIGHTS}, accuracy_level 4, row-invariant graphs (revision {FAST_REVISION})"
                   if fast else "")
    return f"exact format: weights served as {weight_format}{level}{steps}{fast_format}"


def _manifest(out: Path, config: dict, architecture, aux: tuple[int, ...], record: ConversionRecord,
              checkpoint: GgufCheckpoint, name: str | None) -> BundleManifest:
    hidden = HiddenOutputs(final=FINAL_HIDDEN, **(dict(zip(("low", "mid", "high"), map(aux_output_name, aux)),
                                                       layer_indices=aux) if len(aux) == 3 else {}))
    entry = ModelEntry(role="target", directory="target", onnx="model.onnx", weights=DATA_FILE, config="config.json",
                       tokenizer="tokenizer.json", parameters=_parameters(architecture, config), architecture=architecture,
                       hidden_outputs=hidden, converted=record)
    shape = (architecture.vocab_size, architecture.hidden_size)
    arrays = {name: ArrayEntry(file=f"target/{name}.npy", shape=shape, dtype="float32", meaning=meaning)
              for name, meaning in (("embed_tokens", "target input embedding table, row t = embedding of token t"),
                                    ("lm_head", "target LM head, logits = hidden @ lm_head.T"))}
    tokens = checkpoint.field("tokenizer.ggml.tokens")
    eos_id = int(config["eos_token_id"])
    kept: dict = {}
    if (out / MANIFEST_NAME).is_file():  # a bundle with trained heads: keep them
        previous = BundleManifest.load(out)
        kept = {"heads": previous.heads, "measurements": previous.measurements, "corpus": previous.corpus}
        models = {role: model for role, model in previous.models.items() if role != "target"}
    else:
        models = {}
    return BundleManifest(name=name, tokenizer="target/tokenizer.json", eos_token=tokens[eos_id], eos_token_id=eos_id,
                          models={"target": entry, **models}, arrays=arrays, **kept)


def _parameters(architecture, config: dict) -> int:
    """Weights the model has (the file's packing aside): Hugging Face's count."""
    a = architecture
    attention = a.hidden_size * a.head_dim * (2 * a.num_heads + 2 * a.num_kv_heads)
    mlp = 3 * a.hidden_size * a.intermediate_size
    embeddings = a.vocab_size * a.hidden_size * (1 if config["tie_word_embeddings"] else 2)
    return a.num_layers * (attention + mlp + 2 * a.hidden_size) + a.hidden_size + embeddings
