"""Convert a published Qwen3.5 multi-token-prediction (MTP) head to specserve's MTP graph.

A Qwen3.5 / Qwen3.6 dense checkpoint (``Qwen/Qwen3.5-27B``, ``Qwen/Qwen3.6-27B``) ships a
one-layer MTP head inside the target's own safetensors, under ``mtp.*``:

    h'         = fc(cat[pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)])    # fc: 2H -> H
    h''        = one full-attention Qwen3.5 decoder layer (gated Q, per-head q/k norm,
                 partial rotary)
    mtp_hidden = norm(h'')

``e`` is the target's embedding of the token the head conditions on, ``h`` the target's
final normalised hidden state (then the head's own previous ``mtp_hidden``). It has no
embedding table and no LM head of its own: the engine's MTP proposer applies the
target's on either side, which is exactly the I/O mobius's ``qwen35-mtp`` task builds
(``mobius/tasks/_qwen35_mtp.py``). Transformers drops ``mtp.*`` on ``from_pretrained``,
so the graph is built from the tensors directly, with mobius's ``Qwen35MtpModel``.

Dev-only, in ``.venv-convert`` (mobius-onnx pulls torch); mobius, torch and onnx are
imported inside :func:`build_qwen35_mtp` so this module imports without them.
"""
from __future__ import annotations

import json
from pathlib import Path

from .weights import apply_every_weight

# The graph contract of the engine's MTP proposer (engine/model/heads.py,
# engine/spec/proposers/mtp.py); float32 throughout except the int64 mask and positions.
CONTRACT_INPUTS = ("inputs_embeds", "hidden_states", "attention_mask", "position_ids",
                   "past_key_values.0.key", "past_key_values.0.value")
CONTRACT_OUTPUTS = ("mtp_hidden", "present.0.key", "present.0.value")

# mobius's name -> the contract's, for any I/O that mobius names differently. mobius-onnx
# 0.1.0's qwen35-mtp task already emits exactly the contract names, so this is empty; a
# mobius that renamed one would fail the check in build_qwen35_mtp until it is mapped here.
_RENAMES: dict[str, str] = {}

SOURCE_FORMAT = "qwen3.5-mtp"
_INDEX_NAME = "model.safetensors.index.json"
# Tensors of a routed-expert MTP layer (Qwen3.5-MoE / Qwen3-Next): mobius's
# Qwen35MtpModel has a dense MLP only, so such a head cannot be built with it.
_MOE_MARKERS = (".mlp.experts.", ".mlp.gate.weight", ".mlp.shared_expert")


def _mtp_weight_files(checkpoint_dir: Path) -> list[Path]:
    """The safetensors files that hold ``mtp.*`` tensors.

    A real checkpoint is sharded (tens of GB) and the head is a few hundred MB in one
    shard: the index names that shard, so only it is opened. Without an index every
    ``*.safetensors`` in the directory is scanned (keys only, no tensor is read)."""
    index = checkpoint_dir / _INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted({file for key, file in weight_map.items() if key.startswith("mtp.")})
        root = checkpoint_dir.resolve()
        paths = [(checkpoint_dir / name).resolve() for name in names]
        for path in paths:
            if root not in path.parents:
                raise ValueError(f"{index}: weight file {path} lies outside the checkpoint")
        return paths
    return sorted(checkpoint_dir.glob("*.safetensors"))


def _load_mtp_tensors(checkpoint_dir: Path) -> dict:
    """Read only the ``mtp.*`` tensors (mobius's own loader would read the whole target)."""
    from safetensors import safe_open

    tensors = {}
    for path in _mtp_weight_files(checkpoint_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key.startswith("mtp."):
                    tensors[key] = f.get_tensor(key)
    if not tensors:
        raise ValueError(f"{checkpoint_dir}: no mtp.* tensors (a checkpoint with mtp_num_hidden_layers: 0, or one "
                         "whose MTP weights were stripped, as quantized re-uploads often are)")
    return tensors


def _check_head_shape(checkpoint_dir: Path, hf_config, tensors: dict) -> None:
    """Refuse heads that mobius's one-layer, dense ``Qwen35MtpModel`` would build wrongly."""
    text = getattr(hf_config, "text_config", None) or hf_config
    layers = getattr(text, "mtp_num_hidden_layers", None)
    if layers is not None and layers != 1:
        raise NotImplementedError(f"{checkpoint_dir}: mtp_num_hidden_layers is {layers}; only a one-layer MTP head "
                                  "converts")
    deeper = sorted({k.split(".")[2] for k in tensors if k.startswith("mtp.layers.") and k.split(".")[2] != "0"})
    if deeper:
        raise NotImplementedError(f"{checkpoint_dir}: MTP layers {deeper} beyond layer 0; only a one-layer MTP "
                                  "head converts")
    moe = sorted(k for k in tensors if any(marker in k for marker in _MOE_MARKERS))
    if moe:
        raise NotImplementedError(f"{checkpoint_dir}: the MTP layer has routed experts (e.g. {moe[0]}); mobius's "
                                  "Qwen35MtpModel builds a dense MLP only")
    if getattr(text, "mtp_use_dedicated_embeddings", False):
        raise NotImplementedError(f"{checkpoint_dir}: mtp_use_dedicated_embeddings is true; the head's graph "
                                  "borrows the target's embedding table")


def _rename_io(model) -> None:
    """Give the graph's inputs and outputs the contract's names (see ``_RENAMES``)."""
    for value in (*model.graph.inputs, *model.graph.outputs):
        if value.name in _RENAMES:
            value.name = _RENAMES[value.name]


def _check_io(onnx_path: Path) -> None:
    """The saved graph's I/O names, in order, and element types are the contract's."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    graph = model.graph
    inputs = tuple(i.name for i in graph.input)
    outputs = tuple(o.name for o in graph.output)
    if inputs != CONTRACT_INPUTS or outputs != CONTRACT_OUTPUTS:
        raise ValueError(f"{onnx_path}: graph I/O {inputs} -> {outputs} is not the MTP contract "
                         f"{CONTRACT_INPUTS} -> {CONTRACT_OUTPUTS}")
    expected = {"attention_mask": onnx.TensorProto.INT64, "position_ids": onnx.TensorProto.INT64}
    name_of = onnx.TensorProto.DataType.Name
    for value in (*graph.input, *graph.output):
        have, want = value.type.tensor_type.elem_type, expected.get(value.name, onnx.TensorProto.FLOAT)
        if have != want:
            raise ValueError(f"{onnx_path}: {value.name} is {name_of(have)}, the contract needs {name_of(want)}")


def build_qwen35_mtp(checkpoint_dir: Path, out_dir: Path) -> dict:
    """Build ``out_dir/model.onnx`` (+ ``model.onnx.data``) from a Hugging Face Qwen3.5 directory.

    ``checkpoint_dir`` holds ``config.json`` (the composite ``qwen3_5`` config, decoder
    fields under ``text_config``) and safetensors with the ``mtp.*`` tensors, usually
    the target's own checkpoint; the main model's tensors are never read. The graph is
    float32 and has the contract's I/O (:data:`CONTRACT_INPUTS`,
    :data:`CONTRACT_OUTPUTS`). Returns the facts the head's config.json records."""
    import dataclasses

    import onnx_ir as ir
    import transformers
    from mobius import build_from_module
    from mobius._configs import Qwen35MtpConfig
    from mobius.models import Qwen35MtpModel

    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    if not (checkpoint_dir / "config.json").is_file():
        raise FileNotFoundError(f"{checkpoint_dir}/config.json is missing")
    hf_config = transformers.AutoConfig.from_pretrained(str(checkpoint_dir))
    tensors = _load_mtp_tensors(checkpoint_dir)
    _check_head_shape(checkpoint_dir, hf_config, tensors)
    quantized = sorted(k for k, v in tensors.items() if not v.is_floating_point() or v.element_size() < 2)
    if quantized:  # FP8 (block scales), AWQ/GPTQ (packed ints): not dequantized here
        raise NotImplementedError(f"{checkpoint_dir}: quantized MTP tensors (e.g. {quantized[0]}, "
                                  f"{tensors[quantized[0]].dtype}); convert from the bf16/fp16/fp32 release")

    # What mobius.build(task="qwen35-mtp") does, minus its weight loading, which reads
    # every shard of the target into memory: the MTP config is read from text_config
    # (one full-attention layer whatever the main stack's pattern), float32.
    config = dataclasses.replace(Qwen35MtpConfig.from_transformers(hf_config), dtype=ir.DataType.FLOAT)
    module = Qwen35MtpModel(config)
    package = build_from_module(module, config, task="qwen35-mtp")
    model = package["model"]
    model.graph.name = "qwen35-mtp"

    apply_every_weight(package, module.preprocess_weights(tensors), checkpoint_dir)  # mtp.fc.weight -> fc.weight

    _rename_io(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    package.save(str(out_dir), progress_bar=False)
    onnx_path = out_dir / "model.onnx"
    _check_io(onnx_path)

    data = out_dir / "model.onnx.data"
    return {
        "source_format": SOURCE_FORMAT,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
        "num_hidden_layers": 1,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "partial_rotary_factor": config.partial_rotary_factor,
        "max_position_embeddings": config.max_position_embeddings,
        "dtype": "float32",
        "onnx": onnx_path.name,
        "external_data": data.name if data.is_file() else None,
    }
