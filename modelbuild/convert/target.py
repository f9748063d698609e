"""The target, converted: mobius builds the ONNX graph from a Hugging Face directory,
with the hidden-state outputs the chosen heads need, and the embedding and LM-head
arrays the heads use outside their graphs are written beside it.

Layer indexing, the one fact that is easy to get wrong: an EAGLE-3 aux layer j
(vLLM's and SGLang's convention, and the bundle's) is the residual stream *entering*
decoder layer j, HF ``hidden_states[j]``. mobius's ``hidden_states.{k}`` is the
*output* of decoder layer k, HF ``hidden_states[k+1]``. So layer j is asked for as
k = j - 1 and renamed ``aux_hidden.{j}`` (``tests/convert/test_target.py`` pins this
against transformers' ``output_hidden_states``). j = 0 (the embeddings) has no mobius
output and is refused.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from specserve.engine.model.manifest import Architecture

from ..weights_file import aux_output_name

FINAL_HIDDEN = "hidden_states"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's and SGLang's EAGLE-3 default: (2, N // 2, N - 3), entering-layer indexing."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class ConvertedTarget:
    directory: Path
    architecture: Architecture
    aux_layers: tuple[int, ...]
    parameters: int


def text_config(config: dict) -> dict:
    """The language model's own config (multimodal checkpoints nest it)."""
    return config.get("text_config", config)


def architecture_of(config: dict) -> Architecture:
    text = text_config(config)
    heads = text["num_attention_heads"]
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    return Architecture(
        vocab_size=text["vocab_size"], hidden_size=text["hidden_size"], num_layers=text["num_hidden_layers"],
        num_heads=heads, num_kv_heads=text.get("num_key_value_heads", heads),
        head_dim=text.get("head_dim") or text["hidden_size"] // heads, intermediate_size=text["intermediate_size"],
        max_position_embeddings=text["max_position_embeddings"],
        rope_theta=float(text.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)))


def convert_target(hf_dir: Path, out_dir: Path, aux_layers: tuple[int, ...]) -> ConvertedTarget:
    """Build ``out_dir/model.onnx`` (+ ``model.onnx.data``) and the arrays, copy the
    config and tokenizer."""
    config = json.loads((hf_dir / "config.json").read_text())
    architecture = architecture_of(config)
    for layer in aux_layers:
        if not 1 <= layer < architecture.num_layers:
            raise ValueError(f"aux layer {layer} is outside 1..{architecture.num_layers - 1}: it is the residual "
                             "stream entering that decoder layer (layer 0, the embeddings, is not an output)")
    build_target_graph(hf_dir, out_dir, aux_layers)
    embed, lm_head = embedding_and_lm_head(hf_dir)
    if text_config(config).get("model_type", "").startswith("gemma"):
        # Gemma scales its embeddings by sqrt(hidden) inside the model; heads are fed what
        # the target's own layers see (transformers' assisted generation does the same).
        # Untested here: no Gemma target is converted in the tests.
        embed = embed * np.float32(architecture.hidden_size ** 0.5)
    if embed.shape != (architecture.vocab_size, architecture.hidden_size) or lm_head.shape != embed.shape:
        raise ValueError(f"{hf_dir}: embedding {embed.shape} / LM head {lm_head.shape} do not match the config's "
                         f"vocab x hidden ({architecture.vocab_size}, {architecture.hidden_size})")
    np.save(out_dir / "embed_tokens.npy", embed)
    np.save(out_dir / "lm_head.npy", lm_head)
    shutil.copy(hf_dir / "config.json", out_dir / "config.json")
    for name in TOKENIZER_FILES:
        if (hf_dir / name).is_file():
            shutil.copy(hf_dir / name, out_dir / name)
    if not (out_dir / "tokenizer.json").is_file():
        raise ValueError(f"{hf_dir} has no tokenizer.json (the engine reads the fast tokenizer's file)")
    return ConvertedTarget(out_dir, architecture, tuple(aux_layers), graph_parameters(out_dir / "model.onnx"))


def build_target_graph(hf_dir: Path, out_dir: Path, aux_layers: tuple[int, ...]) -> Path:
    """mobius's graph of ``hf_dir`` in ``out_dir``, asking for aux layer j as mobius index
    j - 1, under the names the engine reads (``adopt_output_names``)."""
    import mobius  # convert extra only: it pulls torch

    out_dir.mkdir(parents=True, exist_ok=True)
    package = mobius.build(str(hf_dir), dtype="f32", output_layer_indices=[j - 1 for j in aux_layers] or None)
    package.save(str(out_dir))
    path = out_dir / "model.onnx"
    adopt_output_names(path, aux_layers)
    return path


def graph_parameters(path: Path) -> int:
    """Weights in an ONNX graph (its initializers), read without loading their data."""
    return sum(int(np.prod(t.dims)) for t in onnx.load(str(path), load_external_data=False).graph.initializer)


def adopt_output_names(path: Path, aux_layers: tuple[int, ...]) -> None:
    """Rename a mobius target's outputs in place: ``hidden_states.{j-1}`` becomes
    ``aux_hidden.{j}``, and the LM head's input (the final norm's output, which every
    head starts from and mobius does not output) is exposed as ``hidden_states``."""
    model = onnx.load(str(path), load_external_data=False)  # the weights stay where they are
    graph = model.graph
    producers = {output: node for node in graph.node for output in node.output}
    head = producers["logits"]
    if head.op_type not in ("MatMul", "Gemm"):
        raise ValueError(f"{path}: logits come from a {head.op_type}, not the LM head's MatMul; cannot find the "
                         "final hidden state (a soft-capped or tied-and-scaled head needs its own rule)")
    final_norm = head.input[0]
    renames = {f"hidden_states.{j - 1}": aux_output_name(j) for j in aux_layers}
    missing = set(renames) - {o.name for o in graph.output}
    if missing:
        raise ValueError(f"{path}: mobius did not output {sorted(missing)}")
    for value in graph.output:
        value.name = renames.get(value.name, value.name)
    for node in graph.node:
        node.output[:] = [renames.get(o, o) for o in node.output]
        node.input[:] = [renames.get(i, i) for i in node.input]
    graph.node.append(helper.make_node("Identity", [final_norm], [FINAL_HIDDEN], name="final_hidden_out"))
    logits = next(o for o in graph.output if o.name == "logits")
    graph.output.append(helper.make_tensor_value_info(FINAL_HIDDEN, logits.type.tensor_type.elem_type,
                                                      ["batch", "sequence_len", None]))
    onnx.save(model, str(path))


def embedding_and_lm_head(hf_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """The input-embedding table and the LM head, float32 ``[V, H]`` (a tied head is the
    embedding table)."""
    from safetensors import safe_open  # convert extra

    found: dict[str, np.ndarray] = {}
    wanted = {"model.embed_tokens.weight": "embed", "model.language_model.embed_tokens.weight": "embed",
              "lm_head.weight": "lm_head"}
    for file in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key in wanted:
                    found[wanted[key]] = f.get_tensor(key).float().numpy()
    if "embed" not in found:
        raise ValueError(f"{hf_dir}: no model.embed_tokens.weight in its safetensors")
    return found["embed"], found.get("lm_head", found["embed"])
