"""What a proposer mode is to the rest of specserve: how its proposers are made, what it
takes from the target, how its drafts are timed, and which Serve deployment hosts it.

Each mode's own class lives beside its proposer (``PromptLookupMode`` in
``prompt_lookup.py``, ``DraftModelMode`` in ``draft_model.py``, the heads' modes in
``mtp.py``, ``eagle3.py`` and ``shared_kv.py``); ``registry.py`` maps mode names to them.
The defaults here are a model-free mode's: no model, nothing taken from the target.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import numpy as np

from specserve.engine.config import EngineConfig, SpeculativeConfig
from specserve.engine.errors import ModelLoadError
from specserve.engine.model.bundle import Bundle
from specserve.engine.model.cached_decoder import CachedDecoder
from specserve.engine.model.heads import HeadModel, load_head
from specserve.engine.speculative.proposers.base import NO_NEEDS, Needs, Proposer
from specserve.engine.speculative.rounds import Anchor


@dataclass
class LoadedProposer:
    """A model-based mode, loaded: a factory of per-sequence proposers sharing one model."""

    mode: str
    new_proposer: Callable[[], Proposer]
    model: CachedDecoder | HeadModel

    @property
    def vocab_size(self) -> int:
        """The target vocabulary its drafts come from."""
        model = self.model
        return model.decoder.vocab_size if isinstance(model, CachedDecoder) else model.embedder.table.shape[0]


class ProposerMode:
    mode: ClassVar[str]
    deployment: ClassVar[str | None] = None  # the Serve deployment hosting it; None = runs inside the coordinator
    description: ClassVar[str]

    @property
    def in_coordinator(self) -> bool:
        """Model-free modes need only the committed tokens the coordinator holds: a hop
        to another process would cost more than the proposal."""
        return self.deployment is None

    def provided_by(self, bundle: Bundle | None) -> bool:
        """Whether ``bundle`` has what this mode needs (a model-free mode needs nothing)."""
        return self.in_coordinator

    def needs(self, bundle: Bundle, target_outputs: set[str] | None = None) -> Needs:
        """What this mode takes from the target, checked against the target's outputs."""
        return NO_NEEDS

    def default_num_drafts(self, speculative: SpeculativeConfig) -> int:
        """Most drafts per round for a request that names no maximum."""
        return speculative.num_speculative_tokens

    def coordinator_state(self, speculative: SpeculativeConfig) -> object | None:
        """What this mode's proposers share across the requests of one coordinator (the
        suffix cache), made once per ``DriverFactory``; None: nothing."""
        return None

    def local_proposer(self, speculative: SpeculativeConfig, num_drafts: int, prompt_len: int = 0,
                       shared: object | None = None) -> Proposer:
        """A per-request proposer of a mode that runs inside the coordinator; ``shared``:
        its ``coordinator_state``."""
        raise ValueError(f"'{self.mode}' does not run inside the coordinator")

    def calibration_anchor(self, loaded: LoadedProposer, kv_len: int) -> Anchor:
        """An anchor of the right shapes (zeros) for timing this mode's drafts: what a
        draft costs does not depend on the values it reads."""
        return Anchor()

    def load(self, bundle: Bundle, config: EngineConfig, target_vocab: int) -> LoadedProposer:
        """Load this mode's model from the bundle (model-based modes only)."""
        raise ModelLoadError(f"'{self.mode}' has no model to load")


class HeadMode(ProposerMode):
    """A head: a small graph that restarts from the target's anchor (its hidden states)
    every pass, so it keeps nothing between rounds, a batched run steps every drafting
    sequence to the call's longest draft count, and there is nothing to catch up."""

    proposer: ClassVar[type]  # the proposer class, made with the loaded head

    def provided_by(self, bundle: Bundle | None) -> bool:
        return bundle is not None and bundle.has_head(self.mode)

    def needs(self, bundle: Bundle, target_outputs: set[str] | None = None) -> Needs:
        config = bundle.head_config(self.mode)
        wiring = config.get("target_hidden_inputs", {})
        names = {n for group in wiring.values() for n in group}
        if target_outputs is not None and names - target_outputs:
            raise ModelLoadError(f"{self.mode} head needs target outputs {sorted(names - target_outputs)}, which the "
                                 f"target does not produce (it has {sorted(target_outputs)})")
        return self.head_needs(bundle, config, wiring)

    def head_needs(self, bundle: Bundle, config: dict, wiring: dict) -> Needs:
        """What the head reads besides the target's final hidden state: nothing, here."""
        return Needs(final_hidden=bundle.final_hidden_output)

    def calibration_anchor(self, loaded: LoadedProposer, kv_len: int) -> Anchor:
        return Anchor(np.zeros(loaded.model.hidden_size, np.float32))

    def load(self, bundle: Bundle, config: EngineConfig, target_vocab: int) -> LoadedProposer:
        head = load_head(self.mode, bundle.head_dir(self.mode), target_vocab, bundle.target_hidden_size,
                         config.device, config.proposer_threads, config.int8_heads)
        make = self.proposer
        return LoadedProposer(self.mode, lambda: make(head), head)
