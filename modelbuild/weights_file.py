"""Facts about the checkpoint file that every graph writer shares, importable without torch
(the fused-graph builder needs only onnx and numpy)."""
from __future__ import annotations

import json
from pathlib import Path

WEIGHTS_FILE = "model.safetensors"
IR_VERSION = 10  # onnxruntime 1.31 reads IR <= 13; onnx >= 1.23 would write 14.


def aux_output_name(layer: int) -> str:
    return f"aux_hidden.{layer}"


def _header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as handle:
        header_len = int.from_bytes(handle.read(8), "little")
        return 8 + header_len, json.loads(handle.read(header_len))


def safetensors_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """``name -> (byte offset, byte length)`` of every tensor in a safetensors file, so an
    ONNX graph can reference the very same bytes as external data."""
    base, header = _header(path)
    return {name: (base + meta["data_offsets"][0], meta["data_offsets"][1] - meta["data_offsets"][0])
            for name, meta in header.items() if name != "__metadata__"}


def safetensors_dtypes(path: Path) -> dict[str, str]:
    """``name -> dtype`` (``F16``, ``I8``, ...) of every tensor in a safetensors file."""
    return {name: meta["dtype"] for name, meta in _header(path)[1].items() if name != "__metadata__"}
