"""Which of a target's graph files serve which calls, per format.

A GGUF converts into two families over one weights file (``modelbuild.from_gguf``):

- ``fast``: the file's Q4_1 blocks and Q8_0 table computed with int8 activations, in a
  row-invariant graph (``modelbuild.invariant_graph``). On CPU its in-place graph serves
  every call, at any batch, each sequence in its own buffer row; its standard graph only
  the calls that gather their pasts (a sliding window, CUDA). Lossless because every row
  is computed alike whatever else the call holds, checked again at load
  (``InPlaceDecoder.row_invariance``).
- ``exact``: the file's weights computed in float32 arithmetic: the standard graph, its
  in-place graph at batch 1 and the step graph on the Q4_1 blocks
  (``engine.model.in_place``). Every other bundle (the fixture, a converted checkpoint)
  has only this family.

``EngineConfig.target_format`` defaults to ``auto``: the fast family where the bundle has
one, whose fidelity to float32 measures above llama.cpp's (docs/models.md, fidelity), and
the exact one elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from specserve.engine.errors import ModelLoadError
from specserve.engine.model.in_place import IN_PLACE_FILE, STEP_FILE

TargetFormat = Literal["auto", "exact", "fast"]
FAST_FILE = "model.fast.onnx"
FAST_IN_PLACE_FILE = "model.fast.inplace.onnx"


@dataclass(frozen=True)
class GraphFamily:
    name: Literal["fast", "exact"]
    standard: str            # serves every call the in-place graphs do not
    in_place: str            # calls in a preallocated buffer (batch 1, or any batch where row_invariant)
    step: str | None         # batch-1 single-token calls, where that file exists
    row_invariant: bool      # the in-place graph serves batches too, one buffer row per sequence


EXACT = GraphFamily("exact", "model.onnx", IN_PLACE_FILE, STEP_FILE, row_invariant=False)
FAST = GraphFamily("fast", FAST_FILE, FAST_IN_PLACE_FILE, None, row_invariant=True)


def has_fast_family(model_dir: Path) -> bool:
    return (model_dir / FAST_FILE).is_file() and (model_dir / FAST_IN_PLACE_FILE).is_file()


def graph_family(model_dir: Path, wanted: TargetFormat, in_place: bool = True) -> GraphFamily:
    """The family serving format ``wanted`` from ``model_dir``. ``auto``: the fast one where
    it exists and its in-place graph will serve (``in_place``: CPU, no sliding window),
    since only that graph is checked row-invariant at load."""
    if wanted == "auto":
        return FAST if in_place and has_fast_family(model_dir) else EXACT
    if wanted == "fast" and not has_fast_family(model_dir):
        raise ModelLoadError(f"{model_dir} has no fast format ({FAST_FILE} and {FAST_IN_PLACE_FILE}): a GGUF "
                             f"converts into it (python -m specserve.modelbuild.convert --gguf); use target_format 'exact' "
                             f"for this model")
    return FAST if wanted == "fast" else EXACT
