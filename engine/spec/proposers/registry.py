"""Loading proposers from a model bundle, shared by the in-process engine and by
proposer replicas (which load only their own kind and never the target ONNX)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from engine.model.cached_decoder import CachedDecoder
from engine.errors import ModelLoadError
from engine.model.heads import HeadModel, load_head
from engine.model.manifest import BundleManifest
from engine.options import EngineConfig
from engine.spec.proposers.base import Needs, Proposer
from engine.spec.proposers.draft_model import DraftModelProposer
from engine.spec.proposers.eagle3 import Eagle3Proposer
from engine.spec.proposers.mtp import MtpProposer
from engine.spec.proposers.shared_kv import SharedKvProposer

HEAD_MODES = ("mtp", "eagle3", "shared_kv")
MODEL_MODES = ("draft_model", *HEAD_MODES)  # modes that need a model besides the target


def head_config(bundle_dir: Path, manifest: BundleManifest, kind: str) -> dict:
    entry = manifest.heads.get(kind)
    if entry is None:
        raise ModelLoadError(f"the bundle at {bundle_dir} has no '{kind}' head")
    return json.loads((bundle_dir / entry.directory / "config.json").read_text())


def head_needs(kind: str, config: dict, final_hidden: str, target_outputs: set[str] | None = None) -> Needs:
    """What a head kind takes from the target, checked against the target's outputs."""
    wiring = config.get("target_hidden_inputs", {})
    names = {n for group in wiring.values() for n in group}
    if target_outputs is not None and names - target_outputs:
        raise ModelLoadError(f"{kind} head needs target outputs {sorted(names - target_outputs)}, which the target "
                             f"does not produce (it has {sorted(target_outputs)})")
    layers = tuple(wiring.get("fused_hidden", ())) if kind == "eagle3" else ()
    return Needs(final_hidden=final_hidden, layer_hiddens=layers,
                 shared_kv_layers=dict(config.get("shared_kv_groups", {})) if kind == "shared_kv" else {})


def load_draft(bundle_dir: Path, manifest: BundleManifest, config: EngineConfig, target_vocab: int) -> CachedDecoder:
    if "draft" not in manifest.models:
        raise ModelLoadError(f"the bundle at {bundle_dir} has no draft model")
    # The draft keeps its full context: it is re-aligned to the target every round.
    draft_config = config.model_copy(update={"sliding_window": None, "sink_tokens": 0,
                                             "intra_op_threads": config.proposer_threads})
    draft = CachedDecoder(bundle_dir / manifest.models["draft"].directory, draft_config)
    if draft.decoder.vocab_size != target_vocab:
        raise ModelLoadError(f"draft vocab {draft.decoder.vocab_size} != target vocab {target_vocab}: a draft "
                             "must share the target's tokenizer")
    return draft


def load_head_model(kind: str, bundle_dir: Path, manifest: BundleManifest, config: EngineConfig,
                    target_vocab: int) -> HeadModel:
    hidden = manifest.models["target"].architecture.hidden_size
    entry = manifest.heads.get(kind)
    if entry is None:
        raise ModelLoadError(f"the bundle at {bundle_dir} has no '{kind}' head")
    return load_head(kind, bundle_dir / entry.directory, target_vocab, hidden, config.device, config.proposer_threads)


def head_proposer_factory(kind: str, head: HeadModel, config: EngineConfig) -> Callable[[], Proposer]:
    if kind == "mtp":
        return lambda: MtpProposer(head, config.speculative.mtp_kv_mode)
    return (lambda: Eagle3Proposer(head)) if kind == "eagle3" else (lambda: SharedKvProposer(head))


def load_proposer_factory(kind: str, bundle_dir: Path, manifest: BundleManifest, config: EngineConfig,
                          target_vocab: int) -> Callable[[], Proposer]:
    """A factory of per-sequence proposers of one model-based kind."""
    if kind == "draft_model":
        draft = load_draft(bundle_dir, manifest, config, target_vocab)
        return lambda: DraftModelProposer(draft)
    if kind in HEAD_MODES:
        return head_proposer_factory(kind, load_head_model(kind, bundle_dir, manifest, config, target_vocab), config)
    raise ModelLoadError(f"'{kind}' is not a model-based proposer (those are {', '.join(MODEL_MODES)})")
