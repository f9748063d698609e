"""Published EAGLE-3 heads, converted: both checkpoint layouts go through mobius's
``eagle3-draft`` task, which strips ``midlayer.`` (SafeAILab / EAGLE repo) or
``layers.0.`` (speculators) and drops the borrowed ``embed_tokens`` and the ``d2t`` /
``t2d`` buffers from the graph. ``d2t`` is kept beside the graph as an array: draft id i
is target id ``i + d2t[i]``.

The graph computes ``fc(fused_hidden) + recycled_hidden``: the published chain feeds the
target's low|mid|high states on the first step (recycled = 0) and its own pre-norm
output afterwards (fused = 0). The head's ``config.json`` says so with
``hidden_chain: fused_first_step``, which the engine's EAGLE-3 proposer follows.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .target import architecture_of
from .weights import apply_every_weight

LAYOUTS = {"LlamaForCausalLMEagle3": "eagle3-safeailab", "Eagle3LlamaForCausalLM": "eagle3-safeailab",
           "Eagle3Speculator": "eagle3-speculators", "Eagle3DraftModel": "eagle3-speculators"}


@dataclass(frozen=True)
class Eagle3Checkpoint:
    directory: Path
    layout: str
    config: dict

    @classmethod
    def read(cls, directory: Path) -> "Eagle3Checkpoint":
        config = json.loads((directory / "config.json").read_text())
        architectures = config.get("architectures") or []
        layout = next((LAYOUTS[a] for a in architectures if a in LAYOUTS), None)
        if layout is None:
            raise ValueError(f"{directory}: architectures {architectures} is not an EAGLE-3 head "
                             f"(known: {', '.join(LAYOUTS)})")
        return cls(directory, layout, config)

    @property
    def layer_config(self) -> dict:
        return self.config.get("transformer_layer_config", self.config)

    def aux_layers(self, target_layers: int) -> tuple[int, int, int] | None:
        """The aux layers this head was trained on, in entering-layer indexing, when its
        config names them (speculators' ``eagle_aux_hidden_state_layer_ids``, taken as-is
        as vLLM does); None means the vLLM/SGLang default for the target's depth."""
        ids = self.config.get("eagle_aux_hidden_state_layer_ids")
        if ids is None:
            return None
        if len(ids) != 3:
            raise ValueError(f"{self.directory}: eagle_aux_hidden_state_layer_ids {ids} must name 3 layers")
        return tuple(int(i) for i in ids)


def load_weights(checkpoint: Eagle3Checkpoint) -> dict:
    """Every tensor of the checkpoint, floats as float32. A published EAGLE-3 ``fc`` has no
    bias (vLLM's and mobius's have none); an all-zero one, which some exports write, is
    dropped, and any other is refused."""
    from safetensors.torch import load_file

    weights = {}
    for file in sorted(checkpoint.directory.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    bias = weights.pop("fc.bias", None)
    if bias is not None and float(bias.abs().max()) > 0:
        raise ValueError(f"{checkpoint.directory}: fc has a bias, which the published EAGLE-3 (and mobius) has not")
    return {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}


def build_graph(checkpoint: Eagle3Checkpoint, weights: dict):
    """mobius's ``Eagle3DraftModel`` built from the checkpoint's config and weights.

    Not ``mobius.build(dir)``: a speculators config has no top-level ``model_type``, so
    transformers' ``AutoConfig`` refuses it and mobius then only looks on the Hub. Both
    layouts go the same explicit way instead: the config class mobius registers for
    EAGLE-3 (it reads the nested ``transformer_layer_config``), the module, the weights.
    """
    import dataclasses
    import types

    import onnx_ir as ir
    from mobius import build_from_module
    from mobius._configs import Eagle3Config
    from mobius.models import Eagle3DraftModel
    from transformers import LlamaConfig

    # transformers' LlamaConfig normalises the rope fields (flat rope_theta or nested
    # rope_parameters) the way mobius's rotary embedding reads them.
    layer = LlamaConfig(**{k: v for k, v in checkpoint.layer_config.items() if k != "architectures"})
    if "transformer_layer_config" in checkpoint.config:
        hf_config = types.SimpleNamespace(**{**checkpoint.config, "transformer_layer_config": layer})
    else:
        hf_config = LlamaConfig(**checkpoint.config)
    config = dataclasses.replace(Eagle3Config.from_transformers(hf_config), dtype=ir.DataType.FLOAT)
    module = Eagle3DraftModel(config)
    package = build_from_module(module, config, "eagle3-draft")
    apply_every_weight(package, module.preprocess_weights(weights), checkpoint.directory)
    return package


def convert_eagle3(checkpoint: Eagle3Checkpoint, out_dir: Path, target_hidden: int, target_vocab: int) -> dict:
    """Build the head's graph and ``d2t.npy`` in ``out_dir``; return the facts for its
    ``config.json``."""
    layer = checkpoint.layer_config
    hidden = layer["hidden_size"]
    if checkpoint.config.get("target_hidden_size") not in (None, hidden) or hidden != target_hidden:
        raise ValueError(f"{checkpoint.directory}: an EAGLE-3 head of width {hidden} for a target of width "
                         f"{target_hidden} (a projected target width is not supported)")
    weights = load_weights(checkpoint)
    out_dir.mkdir(parents=True, exist_ok=True)
    build_graph(checkpoint, weights).save(str(out_dir))
    draft_vocab = int(weights["lm_head.weight"].shape[0])
    facts = {"head_type": "eagle3", "source_format": checkpoint.layout, "hidden_size": hidden,
             "num_attention_heads": layer["num_attention_heads"],
             "num_key_value_heads": layer.get("num_key_value_heads", layer["num_attention_heads"]),
             "head_dim": architecture_of(layer).head_dim, "vocab_size": target_vocab,
             "draft_vocab_size": draft_vocab, "hidden_chain": "fused_first_step"}
    if "d2t" in weights:
        d2t = weights["d2t"].numpy().astype(np.int64)
        if d2t.shape != (draft_vocab,):
            raise ValueError(f"{checkpoint.directory}: d2t has shape {d2t.shape}, the LM head {draft_vocab} rows")
        mapped = np.arange(draft_vocab) + d2t
        if mapped.min() < 0 or mapped.max() >= target_vocab:
            raise ValueError(f"{checkpoint.directory}: d2t maps draft ids outside the target's {target_vocab} tokens")
        np.save(out_dir / "d2t.npy", d2t)
        facts["d2t"] = "d2t.npy"
    elif draft_vocab != target_vocab:
        raise ValueError(f"{checkpoint.directory}: a draft vocabulary of {draft_vocab} without d2t")
    return facts
