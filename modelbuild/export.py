"""ONNX export with optimum-style I/O names plus hidden-state outputs.

The float weights are stored once, as float16 in ``model.safetensors`` (the checkpoint
transformers can load); the ONNX graph references the very same bytes as external data
and casts them to float32 in-graph. That keeps ``models/`` small and guarantees the ONNX
model and the checkpoint are the same weights.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper
from safetensors.torch import save_file
from torch import nn

from .llama import LlamaForCausalLM
from .int8_storage import BLOCK, SCALE_SUFFIX, dequant_nodes, dequantize_blocks, quantize_blocks, stored_as_int8
from .weights_file import IR_VERSION, WEIGHTS_FILE, aux_output_name, safetensors_dtypes, safetensors_offsets

__all__ = ["WEIGHTS_FILE", "aux_output_name", "export_onnx", "export_graph", "save_checkpoint"]

OPSET = 17


class _ExportWrapper(nn.Module):
    """Flat-tensor interface for the tracer: ``(ids, mask, positions, *past) -> outputs``."""

    def __init__(self, model: LlamaForCausalLM, aux_layers: tuple[int, ...]) -> None:
        super().__init__()
        self.inner = model
        self.aux_layers = aux_layers

    def forward(self, input_ids, attention_mask, position_ids, *flat_past):
        past = [(flat_past[2 * i], flat_past[2 * i + 1]) for i in range(len(flat_past) // 2)]
        logits, presents, hidden = self.inner(input_ids, attention_mask, position_ids, past)
        outputs = [logits]
        for key, value in presents:
            outputs += [key, value]
        outputs.append(hidden[-1])
        outputs += [hidden[j] for j in self.aux_layers]
        return tuple(outputs)


def save_checkpoint(model: nn.Module, out_dir: Path, hf_config: dict, int8_matrices: bool = False
                    ) -> dict[str, torch.Tensor]:
    """Write ``model.safetensors`` (float16) + ``config.json``; return the saved tensors.
    ``int8_matrices``: its weight matrices as int8 blocks (``int8_storage``), and the
    model's own weights set to what they dequantize to, so it computes what the graph does."""
    tensors = {name: t.detach().to(torch.float16).contiguous() for name, t in model.state_dict().items()
               if name != "inv_freq"}
    if int8_matrices:
        state = model.state_dict()
        for name in stored_as_int8({name: tuple(t.shape) for name, t in tensors.items()}):
            q, scale = quantize_blocks(state[name].detach().float().numpy())
            with torch.no_grad():
                state[name].copy_(torch.from_numpy(dequantize_blocks(q, scale)))
            tensors[name], tensors[name + SCALE_SUFFIX] = torch.from_numpy(q), torch.from_numpy(scale)
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    return tensors


def export_onnx(model: LlamaForCausalLM, out_dir: Path, aux_layers: tuple[int, ...] = ()) -> Path:
    """Export, then point every weight initializer at its float16 bytes in the checkpoint."""
    shape = model.shape
    wrapper = _ExportWrapper(model, aux_layers).eval()
    batch, new, past_len = 1, 3, 5  # a non-empty past: an empty one freezes a branch into the graph
    ids = torch.randint(0, shape.vocab_size, (batch, new))
    mask = torch.ones(batch, past_len + new, dtype=torch.long)
    pos = torch.arange(past_len, past_len + new).unsqueeze(0)
    past = [torch.randn(batch, shape.num_kv_heads, past_len, shape.head_dim) for _ in range(2 * shape.num_layers)]
    past_names, present_names, dynamic = [], [], {
        "input_ids": {0: "batch", 1: "sequence"},
        "attention_mask": {0: "batch", 1: "total_sequence"},
        "position_ids": {0: "batch", 1: "sequence"},
        "logits": {0: "batch", 1: "sequence"},
        "hidden_states": {0: "batch", 1: "sequence"},
    }
    for i in range(shape.num_layers):
        for kind in ("key", "value"):
            past_names.append(f"past_key_values.{i}.{kind}")
            present_names.append(f"present.{i}.{kind}")
            dynamic[past_names[-1]] = {0: "batch", 2: "past_sequence"}
            dynamic[present_names[-1]] = {0: "batch", 2: "total_sequence"}
    aux_names = [aux_output_name(j) for j in aux_layers]
    for name in aux_names:
        dynamic[name] = {0: "batch", 1: "sequence"}
    return export_graph(wrapper, (ids, mask, pos, *past), ["input_ids", "attention_mask", "position_ids", *past_names],
                        ["logits", *present_names, "hidden_states", *aux_names], dynamic, out_dir)


def export_graph(wrapper: nn.Module, example: tuple, input_names: list[str], output_names: list[str],
                 dynamic_axes: dict, out_dir: Path) -> Path:
    """Trace ``wrapper`` (whose weights live under ``wrapper.inner``, already saved to
    ``out_dir/model.safetensors``) to ``out_dir/model.onnx`` reading those weights."""
    onnx_path = out_dir / "model.onnx"
    with torch.no_grad():
        torch.onnx.export(
            wrapper, example, str(onnx_path), input_names=input_names, output_names=output_names,
            dynamic_axes=dynamic_axes, opset_version=OPSET, do_constant_folding=False, dynamo=False,
        )
    _externalise_weights(onnx_path, out_dir / WEIGHTS_FILE, prefix="inner.")
    return onnx_path


def _externalise_weights(onnx_path: Path, weights_path: Path, prefix: str) -> None:
    graph_model = onnx.load(str(onnx_path))
    graph = graph_model.graph
    offsets, dtypes = safetensors_offsets(weights_path), safetensors_dtypes(weights_path)

    def external(tensor_name: str, stored: str, data_type: int, dims: list[int], width: int) -> TensorProto:
        offset, length = offsets[stored]
        if length != int(np.prod(dims)) * width:
            raise RuntimeError(f"{stored}: checkpoint holds {length} bytes, graph needs {int(np.prod(dims)) * width}")
        tensor = TensorProto(name=tensor_name, data_type=data_type, dims=dims)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", weights_path.name), ("offset", str(offset)), ("length", str(length))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        return tensor

    kept, casts, renamed = [], [], {}
    for init in graph.initializer:
        name = init.name[len(prefix):] if init.name.startswith(prefix) else init.name
        if name not in offsets or init.data_type != TensorProto.FLOAT:
            kept.append(init)
            continue
        dims = list(init.dims)
        if dtypes[name] == "I8":  # int8 blocks (int8_storage): dequantized by foldable nodes
            n, k = dims
            kept += [external(name, name, TensorProto.INT8, dims, 1),
                     external(name + SCALE_SUFFIX, name + SCALE_SUFFIX, TensorProto.FLOAT16, [n, k // BLOCK], 2)]
            nodes, shapes = dequant_nodes(name, n, k, init.name)
            casts += nodes
            kept += shapes
        else:
            kept.append(external(name + ".fp16", name, TensorProto.FLOAT16, dims, 2))
            casts.append(helper.make_node("Cast", [name + ".fp16"], [init.name], to=TensorProto.FLOAT,
                                          name=f"cast/{name}"))
        renamed[init.name] = name
    # The tracer merges byte-identical initializers (e.g. untrained all-ones norms), so a
    # checkpoint tensor may have no initializer of its own; the export check after
    # saving compares outputs, which is what proves the graph reads the right weights.
    del graph.initializer[:]
    graph.initializer.extend(kept)
    nodes = list(graph.node)
    del graph.node[:]
    graph.node.extend(casts + nodes)
    graph_model.ir_version = IR_VERSION
    onnx.save(graph_model, str(onnx_path))
