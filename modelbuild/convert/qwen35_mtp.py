"""Convert a published Qwen3.5 / Qwen3-Next multi-token-prediction (MTP) head to specserve's MTP graph.

A Qwen3.5 / Qwen3.6 checkpoint (``Qwen/Qwen3.5-27B``, ``Qwen/Qwen3.6-27B``, the MoE
``Qwen/Qwen3.5-35B-A3B``, ``Qwen/Qwen3.6-35B-A3B``) and a Qwen3-Next one
(``Qwen/Qwen3-Next-80B-A3B-Instruct``) ship a one-layer MTP head inside the target's own
safetensors, under ``mtp.*``:

    h'         = fc(cat[pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)])    # fc: 2H -> H
    h''        = one full-attention decoder layer (gated Q, per-head q/k norm, partial
                 rotary); its MLP is dense (Qwen3.5) or a sparse MoE with a
                 sigmoid-gated shared expert (Qwen3.5-MoE, Qwen3-Next)
    mtp_hidden = norm(h'')

``e`` is the target's embedding of the token the head conditions on, ``h`` the target's
final normalised hidden state (then the head's own previous ``mtp_hidden``). It has no
embedding table and no LM head of its own: the engine's MTP proposer applies the
target's on either side, which is exactly the I/O mobius's ``qwen35-mtp`` task builds
(``mobius/tasks/_qwen35_mtp.py``). Transformers drops ``mtp.*`` on ``from_pretrained``,
so the graph is built from the tensors directly, with mobius's ``Qwen35MtpModel`` (whose
one decoder layer is swapped for mobius's Qwen3.5-MoE or Qwen3-Next layer when the
head is MoE).

The MoE head's routed experts are published two ways, both read:

- per expert, ``mtp.layers.0.mlp.experts.{i}.{gate,up,down}_proj.weight`` (Qwen3-Next,
  Qwen3.5-MoE; vLLM's ``qwen3_next_mtp.py`` / ``qwen3_5_mtp.py`` and transformers'
  ``qwen2_moe`` conversion mapping load this layout),
- packed, ``mtp.layers.0.mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows, then up
  rows) and ``mtp.layers.0.mlp.experts.down_proj`` ``[E, H, I]``, no ``.weight`` suffix
  (Qwen3.6-35B-A3B; the layout of transformers' ``Qwen3_5MoeExperts`` parameters).

Router ``mtp.layers.0.mlp.gate.weight`` ``[E, H]``, shared expert
``mtp.layers.0.mlp.shared_expert.{gate,up,down}_proj.weight`` and its gate
``mtp.layers.0.mlp.shared_expert_gate.weight`` ``[1, H]``.

Dev-only, in ``.venv-convert`` (mobius-onnx pulls torch); mobius, torch and onnx are
imported inside :func:`build_qwen35_mtp` so this module imports without them.
"""
from __future__ import annotations

import json
from pathlib import Path

from .weights import apply_every_weight

# The graph contract of the engine's MTP proposer (engine/model/heads.py,
# engine/speculative/proposers/mtp.py); float32 throughout except the int64 mask and positions.
CONTRACT_INPUTS = ("inputs_embeds", "hidden_states", "attention_mask", "position_ids",
                   "past_key_values.0.key", "past_key_values.0.value")
CONTRACT_OUTPUTS = ("mtp_hidden", "present.0.key", "present.0.value")

# mobius's name -> the contract's, for any I/O that mobius names differently. mobius-onnx
# 0.1.0's qwen35-mtp task already emits exactly the contract names, so this is empty; a
# mobius that renamed one would fail the check in build_qwen35_mtp until it is mapped here.
_RENAMES: dict[str, str] = {}

SOURCE_FORMAT = "qwen3.5-mtp"  # the dense head's; SOURCE_FORMATS has every family's
_INDEX_NAME = "model.safetensors.index.json"

# config.json's model_type (the composite one, or a text-only checkpoint's) -> family.
_FAMILIES = {
    "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe", "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_next": "qwen3_next",
}
SOURCE_FORMATS = {"qwen3_5": SOURCE_FORMAT, "qwen3_5_moe": "qwen3.5-moe-mtp", "qwen3_next": "qwen3-next-mtp"}
_MOE_FAMILIES = frozenset({"qwen3_5_moe", "qwen3_next"})

_LAYER = "mtp.layers.0."
# Tensors of a routed-expert MTP layer (either expert layout) and of a dense one (an
# expert's or the shared expert's projections never match the dense markers).
_MOE_MARKERS = (".mlp.experts.", ".mlp.gate.weight", ".mlp.shared_expert")
_DENSE_MARKERS = (".mlp.gate_proj.", ".mlp.up_proj.", ".mlp.down_proj.")
_PACKED_GATE_UP = _LAYER + "mlp.experts.gate_up_proj"
_PACKED_DOWN = _LAYER + "mlp.experts.down_proj"


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


def _family(checkpoint_dir: Path, hf_config) -> str:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _FAMILIES:
        raise NotImplementedError(f"{checkpoint_dir}: model_type {model_type!r} is not a Qwen3.5 / Qwen3.5-MoE / "
                                  f"Qwen3-Next checkpoint (one of {sorted(_FAMILIES)})")
    return _FAMILIES[model_type]


def _check_head_shape(checkpoint_dir: Path, hf_config, tensors: dict, family: str) -> None:
    """Refuse heads mobius's one-layer ``Qwen35MtpModel`` (and its MoE variant) would build wrongly."""
    text = getattr(hf_config, "text_config", None) or hf_config
    layers = getattr(text, "mtp_num_hidden_layers", None)
    if layers is None:
        layers = getattr(text, "num_nextn_predict_layers", None)
    if layers is not None and layers != 1:
        raise NotImplementedError(f"{checkpoint_dir}: the config asks for {layers} MTP layers; only a one-layer MTP "
                                  "head converts")
    deeper = sorted({k.split(".")[2] for k in tensors if k.startswith("mtp.layers.") and k.split(".")[2] != "0"})
    if deeper:
        raise NotImplementedError(f"{checkpoint_dir}: MTP layers {deeper} beyond layer 0; only a one-layer MTP "
                                  "head converts")
    if getattr(text, "mtp_use_dedicated_embeddings", False):
        raise NotImplementedError(f"{checkpoint_dir}: mtp_use_dedicated_embeddings is true; the head's graph "
                                  "borrows the target's embedding table")
    moe = sorted(k for k in tensors if any(marker in k for marker in _MOE_MARKERS))
    dense = sorted(k for k in tensors if any(marker in k for marker in _DENSE_MARKERS))
    if family in _MOE_FAMILIES:
        if dense or not moe:
            raise ValueError(f"{checkpoint_dir}: a {getattr(hf_config, 'model_type', family)} config, but the MTP "
                             f"layer's MLP is dense ({(dense or ['no mlp.gate.weight'])[0]}); mobius builds its MoE "
                             "MTP layer only")
    elif moe:
        raise ValueError(f"{checkpoint_dir}: a dense {getattr(hf_config, 'model_type', family)} config, but the MTP "
                         f"layer has routed experts (e.g. {moe[0]}); a MoE head needs its MoE config "
                         f"(model_type {' or '.join(sorted(k for k, v in _FAMILIES.items() if v in _MOE_FAMILIES))})")


def _unpack_experts(checkpoint_dir: Path, tensors: dict) -> dict:
    """The packed expert tensors (Qwen3.6-35B-A3B), split into mobius's per-expert weights.

    ``experts.gate_up_proj`` ``[E, 2I, H]`` holds each expert's gate rows then its up
    rows (transformers' ``Qwen3_5MoeExperts`` chunks the product in two, gate first);
    ``experts.down_proj`` ``[E, H, I]`` is each expert's down projection as stored by
    ``nn.Linear``. The per-expert layout (Qwen3-Next, Qwen3.5-MoE) passes through."""
    packed = {_PACKED_GATE_UP, _PACKED_DOWN} & set(tensors)
    if not packed:
        return tensors
    if len(packed) != 2:
        raise ValueError(f"{checkpoint_dir}: packed MTP experts need both {_PACKED_GATE_UP} and {_PACKED_DOWN}; "
                         f"found only {sorted(packed)}")
    per_expert = sorted(k for k in tensors if k.startswith(_LAYER + "mlp.experts.") and k not in packed)
    if per_expert:
        raise ValueError(f"{checkpoint_dir}: MTP experts both packed and per expert (e.g. {per_expert[0]})")
    gate_up, down = tensors[_PACKED_GATE_UP], tensors[_PACKED_DOWN]
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0] or gate_up.shape[1] % 2 \
            or gate_up.shape[1] // 2 != down.shape[2] or gate_up.shape[2] != down.shape[1]:
        raise ValueError(f"{checkpoint_dir}: packed MTP experts of mismatched shapes: gate_up_proj "
                         f"{tuple(gate_up.shape)}, down_proj {tuple(down.shape)} (want [E, 2I, H] and [E, H, I])")
    half = gate_up.shape[1] // 2
    out = {k: v for k, v in tensors.items() if k not in packed}
    for i in range(gate_up.shape[0]):
        prefix = f"{_LAYER}mlp.experts.{i}."
        out[prefix + "gate_proj.weight"] = gate_up[i, :half].contiguous()
        out[prefix + "up_proj.weight"] = gate_up[i, half:].contiguous()
        out[prefix + "down_proj.weight"] = down[i].contiguous()
    return out


def _mtp_module(family: str, config):
    """mobius's ``Qwen35MtpModel``, its one decoder layer the family's (MoE for MoE heads).

    The dense head is mobius's model as is. For the MoE families the layer is mobius's own
    full-attention MoE decoder layer: ``Qwen35MoEDecoderLayer`` (routing: softmax over the
    top-k logits, i.e. top-k of the softmax renormalised, as Qwen3.5-MoE always does) or
    ``Qwen3NextDecoderLayer`` (softmax over every expert, top-k, renormalised when
    ``norm_topk_prob``), each with a sigmoid-gated shared expert; attention, norms and
    weight names are the dense layer's."""
    from onnxscript import nn
    from mobius.models import Qwen35MtpModel

    if family not in _MOE_FAMILIES:
        return Qwen35MtpModel(config)
    if family == "qwen3_next":
        from mobius.models.qwen3_next import Qwen3NextDecoderLayer as layer_class
    else:
        from mobius.models.qwen35 import Qwen35MoEDecoderLayer as layer_class

    module = Qwen35MtpModel(config)
    module.layers = nn.ModuleList([layer_class(config, layer_idx=0)])
    return module


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
    """Build ``out_dir/model.onnx`` (+ ``model.onnx.data``) from a Hugging Face Qwen3.5 / Qwen3-Next directory.

    ``checkpoint_dir`` holds ``config.json`` (the composite ``qwen3_5`` / ``qwen3_5_moe``
    config with the decoder fields under ``text_config``, or a flat ``qwen3_next`` one)
    and safetensors with the ``mtp.*`` tensors, usually the target's own checkpoint; the
    main model's tensors are never read. The graph is float32 and has the contract's I/O
    (:data:`CONTRACT_INPUTS`, :data:`CONTRACT_OUTPUTS`) whatever the family. Returns the
    facts the head's config.json records, ``source_format`` one of
    :data:`SOURCE_FORMATS`."""
    import dataclasses

    import onnx_ir as ir
    import transformers
    from mobius import build_from_module
    from mobius._configs import Qwen35MtpConfig

    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    if not (checkpoint_dir / "config.json").is_file():
        raise FileNotFoundError(f"{checkpoint_dir}/config.json is missing")
    hf_config = transformers.AutoConfig.from_pretrained(str(checkpoint_dir))
    family = _family(checkpoint_dir, hf_config)
    tensors = _load_mtp_tensors(checkpoint_dir)
    quantized = sorted(k for k, v in tensors.items() if not v.is_floating_point() or v.element_size() < 2)
    if quantized:  # FP8 (block scales), AWQ/GPTQ (packed ints): not dequantized here
        raise NotImplementedError(f"{checkpoint_dir}: quantized MTP tensors (e.g. {quantized[0]}, "
                                  f"{tensors[quantized[0]].dtype}); convert from the bf16/fp16/fp32 release")
    scales = sorted(k for k in tensors if k.endswith(("_scale", "_scale_inv", ".scales", ".qzeros", ".g_idx")))
    if scales:  # a quantized layout whose weights happened to be stored in a float type
        raise NotImplementedError(f"{checkpoint_dir}: quantization tensors in the MTP head (e.g. {scales[0]}); "
                                  "convert from the bf16/fp16/fp32 release")
    _check_head_shape(checkpoint_dir, hf_config, tensors, family)
    tensors = _unpack_experts(checkpoint_dir, tensors)

    # What mobius.build(task="qwen35-mtp") does, minus its weight loading, which reads
    # every shard of the target into memory: the MTP config is read from text_config
    # (or the flat Qwen3-Next config), one full-attention layer whatever the main
    # stack's pattern, float32.
    config = dataclasses.replace(Qwen35MtpConfig.from_transformers(hf_config), dtype=ir.DataType.FLOAT)
    module = _mtp_module(family, config)
    package = build_from_module(module, config, task="qwen35-mtp")
    model = package["model"]
    model.graph.name = SOURCE_FORMATS[family]

    apply_every_weight(package, module.preprocess_weights(tensors), checkpoint_dir)  # mtp.fc.weight -> fc.weight

    _rename_io(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    package.save(str(out_dir), progress_bar=False)
    onnx_path = out_dir / "model.onnx"
    _check_io(onnx_path)

    data = out_dir / "model.onnx.data"
    moe = family in _MOE_FAMILIES
    facts = {
        "source_format": SOURCE_FORMATS[family],
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate_size": None if moe else config.intermediate_size,
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
    if moe:
        facts.update(num_experts=config.num_local_experts, num_experts_per_tok=config.num_experts_per_tok,
                     moe_intermediate_size=config.moe_intermediate_size,
                     shared_expert_intermediate_size=config.shared_expert_intermediate_size,
                     # Qwen3.5-MoE always renormalises the top-k; Qwen3-Next when norm_topk_prob.
                     norm_topk_prob=bool(config.norm_topk_prob) if family == "qwen3_next" else True)
    return facts
