"""The draft model's graphs, written at install from its committed layers
(``draft/model.safetensors``, float16) and the target's embedding table
(``target/embed_tokens.npy``, converted from the GGUF): the draft ties and freezes the
target's embeddings, so they are never committed twice (``modelbuild.distill.draft_model``).

Its LM head is the table's rows of the draft vocabulary (``draft/d2t.npy``) and its logits
are scattered into the full vocabulary, every other id at ``MASKED_LOGIT``: the graph keeps
the draft-model contract (logits over the target's vocabulary) while a step pays for 8192
rows, not 49152. Drafts may be inexact; the target verifies every one, so the embedding
table is stored in float16 here.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from onnx import TensorProto

from ..fused_graph import IN_PLACE_FILE, HalfSafetensors, _Graph, build_fused_decoder
from .weights import ExternalData

DRAFT_WEIGHTS = "model.safetensors"
DATA_FILE = "model.onnx.data"
MASKED_LOGIT = -1e4  # exp() underflows to 0 against any real logit: ids outside the draft vocabulary are never drafted
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class DraftWeights(HalfSafetensors):
    """The draft's own layers from its checkpoint; its embedding and LM head from the target's table."""

    def __init__(self, directory: Path, table: np.ndarray, draft_ids: np.ndarray, store: ExternalData) -> None:
        super().__init__(directory / DRAFT_WEIGHTS)
        self.table, self.draft_ids, self.store = table, draft_ids, store

    def embedding(self, g: _Graph, ids: str, name: str, vocab: int, hidden: int) -> str:
        g.initializers.append(self.store.tensor("embed.fp16", self.table.astype(np.float16)))
        table = g.one("Cast", ["embed.fp16"], to=TensorProto.FLOAT, name="cast/embed")
        return g.one("Gather", [table, ids], name="embed")

    def linear(self, g: _Graph, x: str, names: list[str], out_sizes: list[int], in_size: int,
               output: str | None = None) -> str:
        if names != ["lm_head.weight"]:
            return super().linear(g, x, names, out_sizes, in_size, output)
        vocab = out_sizes[0]
        g.initializers.append(self.store.tensor("lm_head.draft_rows.t", np.ascontiguousarray(self.table[self.draft_ids].T)))
        rows = g.one("MatMul", [x, "lm_head.draft_rows.t"])                              # [B, S, V_draft]
        shape = g.one("Concat", [g.one("Slice", [g.one("Shape", [x]), g.const("zero1", np.array([0], np.int64)),
                                                 g.const("two1", np.array([2], np.int64))]),
                                 g.const("vocab1", np.array([vocab], np.int64))], axis=0)
        full = g.one("Expand", [g.const("masked", np.full((1, 1, vocab), MASKED_LOGIT, np.float32)), shape])
        where = g.one("Expand", [g.const("draft_ids", self.draft_ids.astype(np.int64)[None, None]), g.one("Shape", [rows])])
        from onnx import helper

        g.nodes.append(helper.make_node("ScatterElements", [full, where, rows], [output or "logits"], axis=2,
                                        name="lm_head"))
        return output or "logits"


def write_draft_graphs(bundle: Path) -> bool:
    """Write ``draft/model.onnx`` and its in-place graph if the bundle has a committed draft
    checkpoint; False where it has none."""
    directory, target = bundle / "draft", bundle / "target"
    if not (directory / DRAFT_WEIGHTS).is_file():
        return False
    config = json.loads((directory / "config.json").read_text())
    d2t = np.load(directory / config["draft_vocabulary"])
    draft_ids = np.arange(len(d2t)) + d2t
    table = np.load(target / "embed_tokens.npy")
    store = ExternalData(directory / DATA_FILE)
    weights = DraftWeights(directory, table, draft_ids, store)
    try:
        build_fused_decoder(directory, directory / "model.onnx", (), weights=weights)
        build_fused_decoder(directory, directory / IN_PLACE_FILE, (), in_place=True, weights=weights)
    finally:
        store.close()
    for name in TOKENIZER_FILES:  # the draft shares the target's tokenizer
        shutil.copy(target / name, directory / name)
    return True
