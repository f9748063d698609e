"""The one registry of proposer kinds: for each speculative mode, how its proposers are
made, what it takes from the target, and which Serve deployment hosts it.

Everything that needs to know about a kind asks here -- the in-process ``Engine``, the
sequence driver (which kinds run inside the coordinator), the proposer replicas
(loading), the router (wiring ``Needs``) and the Serve builder (deployment names) --
so adding a kind is one entry, not edits in seven places.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from engine.config import EngineConfig, SpeculativeConfig
from engine.errors import ModelLoadError
from engine.model.bundle import Bundle
from engine.model.cached_decoder import CachedDecoder
from engine.model.heads import HeadModel, load_head
from engine.spec.proposers.base import NO_NEEDS, Needs, Proposer, SharedKvSlice
from engine.spec.proposers.draft_model import DraftModelProposer
from engine.spec.proposers.eagle3 import Eagle3Proposer
from engine.spec.proposers.mtp import MtpProposer
from engine.spec.proposers.prompt_lookup import PromptLookupProposer
from engine.spec.proposers.shared_kv import SharedKvProposer
from engine.spec.rounds import Anchor

@dataclass
class LoadedProposer:
    """A model-based kind, loaded: a factory of per-sequence proposers sharing one model."""

    mode: str
    new_proposer: Callable[[], Proposer]
    model: CachedDecoder | HeadModel

    @property
    def vocab_size(self) -> int:
        """The target vocabulary its drafts come from."""
        model = self.model
        return model.decoder.vocab_size if isinstance(model, CachedDecoder) else model.embedder.table.shape[0]


@dataclass(frozen=True)
class ProposerKind:
    mode: str
    deployment: str | None   # the Serve deployment hosting it; None = runs inside the coordinator
    description: str

    @property
    def in_coordinator(self) -> bool:
        """Model-free kinds need only the committed tokens the coordinator holds: a hop
        to another process would cost more than the proposal."""
        return self.deployment is None

    def provided_by(self, bundle: Bundle | None) -> bool:
        if self.in_coordinator:
            return True
        if bundle is None:
            return False
        return bundle.has_draft() if self.mode == "draft_model" else bundle.has_head(self.mode)

    def needs(self, bundle: Bundle, target_outputs: set[str] | None = None) -> Needs:
        """What this kind takes from the target, checked against the target's outputs."""
        if self.mode not in HEAD_MODES:
            return NO_NEEDS
        config = bundle.head_config(self.mode)
        wiring = config.get("target_hidden_inputs", {})
        names = {n for group in wiring.values() for n in group}
        if target_outputs is not None and names - target_outputs:
            raise ModelLoadError(f"{self.mode} head needs target outputs {sorted(names - target_outputs)}, which the "
                                 f"target does not produce (it has {sorted(target_outputs)})")
        layers = tuple(wiring.get("fused_hidden", ())) if self.mode == "eagle3" else ()
        groups = dict(config.get("shared_kv_groups", {})) if self.mode == "shared_kv" else {}
        return Needs(final_hidden=bundle.final_hidden_output, layer_hiddens=layers, shared_kv_layers=groups)

    def local_proposer(self, speculative: SpeculativeConfig, num_drafts: int) -> Proposer:
        """A per-request proposer of a kind that runs inside the coordinator."""
        if self.mode != "prompt_lookup":
            raise ValueError(f"'{self.mode}' does not run inside the coordinator")
        return PromptLookupProposer(speculative.prompt_lookup_ngram, num_drafts)

    def calibration_anchor(self, loaded: LoadedProposer, kv_len: int) -> Anchor:
        """An anchor of the right shapes (zeros) for timing this kind's drafts: what a
        draft costs does not depend on the values it reads."""
        if self.mode not in HEAD_MODES:
            return Anchor()
        head: HeadModel = loaded.model
        hidden = np.zeros(head.hidden_size, np.float32)
        layers = (hidden,) * 3 if self.mode == "eagle3" else None
        slices = None
        if self.mode == "shared_kv":
            slices = []
            for group, layer in head.config.get("shared_kv_groups", {}).items():
                _, heads, _, dim = head.input_shape(f"shared_kv.{group}.key")
                kv = np.zeros((1, int(heads), kv_len, int(dim)), np.float32)
                slices.append(SharedKvSlice(group, layer, kv, kv))
            slices = tuple(slices)
        return Anchor(hidden, layers, slices)

    def load(self, bundle: Bundle, config: EngineConfig, target_vocab: int) -> LoadedProposer:
        """Load this kind's model from the bundle (model-based kinds only)."""
        if self.in_coordinator:
            raise ModelLoadError(f"'{self.mode}' has no model to load")
        if self.mode == "draft_model":
            draft = _load_draft(bundle, config, target_vocab)
            return LoadedProposer(self.mode, lambda: DraftModelProposer(draft), draft)
        head = load_head(self.mode, bundle.head_dir(self.mode), target_vocab, bundle.target_hidden_size,
                         config.device, config.proposer_threads, config.int8_heads)
        make = {"mtp": MtpProposer, "eagle3": Eagle3Proposer, "shared_kv": SharedKvProposer}[self.mode]
        return LoadedProposer(self.mode, lambda: make(head), head)


# Heads restart from the target's anchor every pass: they keep nothing between rounds, a
# batched run steps every drafting sequence to the call's longest draft count, and there
# is nothing to catch up.
HEAD_MODES = ("mtp", "eagle3", "shared_kv")

PROPOSER_KINDS: dict[str, ProposerKind] = {k.mode: k for k in (
    ProposerKind("prompt_lookup", None, "n-gram copy from the context (no model)"),
    ProposerKind("draft_model", "DraftModelProposer", "a small LM with its own paged KV cache"),
    ProposerKind("mtp", "MtpProposer", "a multi-token-prediction head read through the target's LM head"),
    ProposerKind("eagle3", "Eagle3Proposer", "an EAGLE-3 head fed low/mid/high target hidden states"),
    ProposerKind("shared_kv", "SharedKvProposer", "a Gemma-4-style assistant reading the target's KV cache"),
)}
MODEL_MODES = tuple(m for m, k in PROPOSER_KINDS.items() if not k.in_coordinator)


def proposer_kind(mode: str) -> ProposerKind:
    try:
        return PROPOSER_KINDS[mode]
    except KeyError:
        raise ModelLoadError(f"unknown proposer kind '{mode}' (known: {', '.join(PROPOSER_KINDS)})") from None


def provided_modes(bundle: Bundle | None) -> list[str]:
    """Every mode a bundle can serve, target-only first."""
    return ["none", *(m for m, k in PROPOSER_KINDS.items() if k.provided_by(bundle))]


def load_proposer(mode: str, bundle: Bundle, config: EngineConfig, target_vocab: int) -> LoadedProposer:
    return proposer_kind(mode).load(bundle, config, target_vocab)


def _load_draft(bundle: Bundle, config: EngineConfig, target_vocab: int) -> CachedDecoder:
    # The draft keeps its full context: it is re-aligned to the target every round.
    draft_config = config.model_copy(update={"sliding_window": None, "sink_tokens": 0,
                                             "intra_op_threads": config.proposer_threads, "in_place_threads": None})
    draft = CachedDecoder(bundle.draft_dir(), draft_config)
    if draft.decoder.vocab_size != target_vocab:
        raise ModelLoadError(f"draft vocab {draft.decoder.vocab_size} != target vocab {target_vocab}: a draft "
                             "must share the target's tokenizer")
    return draft
