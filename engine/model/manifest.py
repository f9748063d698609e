"""The bundle manifest: which file is which in ``models/``, validated on load.

Written by ``python -m specserve.modelbuild`` and read by the engine, so a bundle that was edited
by hand or half rebuilt fails loudly with the field that is wrong.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MANIFEST_NAME = "manifest.json"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Architecture(_Strict):
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    rope_theta: float
    rms_norm_eps: float


class HiddenOutputs(_Strict):
    """ONNX output names of the hidden states that proposer heads consume."""

    final: str = Field(description="final normalised hidden state (what the LM head reads)")
    low: str | None = None
    mid: str | None = None
    high: str | None = None
    layer_indices: tuple[int, int, int] | None = Field(
        default=None, description="j of low/mid/high: the residual stream entering decoder layer j")


class TrainingRecord(_Strict):
    seed: int
    steps: int
    batch_size: int
    seq_len: int
    learning_rate: float
    objective: str
    tokens_seen: int
    seconds: float


class ConversionRecord(_Strict):
    """Where a converted model came from (``python -m specserve.modelbuild.convert``), in place of
    a training record: the bundle's own models are trained here, a user's are converted."""

    source: str = Field(description="what it was converted from: a Hugging Face directory, or a GGUF and where it came from")
    source_format: str = Field(description="the checkpoint layout, e.g. llama, eagle3-safeailab, qwen3.5-mtp")
    tool: str = Field(description="the exporter and its version")
    sha256: str | None = Field(None, description="of the source file, where it is one file (a GGUF)")
    notes: str = ""


class _Provenance(_Strict):
    training: TrainingRecord | None = None
    converted: ConversionRecord | None = None

    @model_validator(mode="after")
    def _one_origin(self):
        if (self.training is None) == (self.converted is None):
            raise ValueError("exactly one of 'training' and 'converted' says where the weights came from")
        return self


class ModelEntry(_Provenance):
    role: Literal["target", "draft"]
    directory: str
    onnx: str
    weights: str = Field(description="the external-data file the ONNX graph reads its weights from")
    config: str
    tokenizer: str
    parameters: int
    architecture: Architecture
    hidden_outputs: HiddenOutputs
    heldout_loss_nats: float | None = None


class HeadEntry(_Provenance):
    """A proposer head, trained against the target here or converted from a published
    checkpoint (see head-contracts.md for its I/O)."""

    kind: Literal["mtp", "eagle3", "shared_kv"]
    directory: str
    onnx: str
    weights: str
    config: str
    parameters: int
    target_hidden_inputs: dict[str, list[str]] = Field(
        description="head input -> target ONNX outputs that feed it (concatenated in order)")
    shared_kv_groups: dict[str, int] = Field(default_factory=dict, description="group -> bound target layer")
    draft_vocab_size: int | None = None
    d2t: str | None = Field(None, description="draft id i -> target id i + d2t[i] (reduced draft vocabulary)")
    uses_arrays: list[str] = Field(default_factory=list, description="target arrays the head needs outside its graph")
    heldout_top1_agreement: list[float] = Field(
        default_factory=list,
        description="fraction of held-out positions where draft step i equals the target's greedy token")


class ArrayEntry(_Strict):
    file: str
    shape: tuple[int, ...]
    dtype: str
    meaning: str


class CorpusRecord(_Strict):
    source: str
    python_version: str
    root: str
    selection: str
    heldout_rule: str
    train_files: dict[str, str]
    heldout_files: dict[str, str]
    train_tokens: int
    heldout_tokens: int
    unigram_cross_entropy_nats: float


class BundleManifest(_Strict):
    format_version: Literal[1] = 1
    name: str | None = Field(None, description="the model's name, served as its id (default: the directory's name)")
    tokenizer: str
    eos_token: str
    eos_token_id: int
    corpus: CorpusRecord | None = Field(None, description="what the bundle's own models were trained on")
    models: dict[str, ModelEntry]
    heads: dict[str, HeadEntry] = Field(default_factory=dict)
    arrays: dict[str, ArrayEntry]
    measurements: dict[str, float] = Field(default_factory=dict)

    @classmethod
    def load(cls, bundle_dir: str | Path) -> "BundleManifest":
        path = Path(bundle_dir) / MANIFEST_NAME
        if not path.is_file():
            raise FileNotFoundError(f"no {MANIFEST_NAME} in {bundle_dir}")
        return cls.model_validate(json.loads(path.read_text()))

    def save(self, bundle_dir: str | Path) -> None:
        (Path(bundle_dir) / MANIFEST_NAME).write_text(self.model_dump_json(indent=2) + "\n")
