"""Facts about the checkpoint file that every graph writer shares, importable without torch
(the fused-graph builder needs only onnx and numpy)."""
from __future__ import annotations

import json
from pathlib import Path

WEIGHTS_FILE = "model.safetensors"
IR_VERSION = 10  # onnxruntime 1.31 reads IR <= 13; onnx >= 1.23 would write 14.


def aux_output_name(layer: int) -> str:
    return f"aux_hidden.{layer}"


def safetensors_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """``name -> (byte offset, byte length)`` of every tensor in a safetensors file, so an
    ONNX graph can reference the very same bytes as external data."""
    with open(path, "rb") as handle:
        header_len = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(header_len))
    base = 8 + header_len
    return {name: (base + meta["data_offsets"][0], meta["data_offsets"][1] - meta["data_offsets"][0])
            for name, meta in header.items() if name != "__metadata__"}
