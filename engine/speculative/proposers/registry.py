"""The one registry of proposer modes: each speculative mode's name, mapped to its
``mode.ProposerMode``, which says how its proposers are made, what it takes from the
target, how its drafts are timed and which Serve deployment hosts it.

Everything that needs to know about a mode asks here -- the in-process ``Engine``, the
sequence driver (which modes run inside the coordinator), the proposer replicas
(loading), the router (wiring ``Needs``) and the Serve builder (deployment names) --
so adding a mode is its class beside its proposer and one entry here.
"""
from __future__ import annotations

from specserve.engine.config import EngineConfig
from specserve.engine.errors import ModelLoadError
from specserve.engine.model.bundle import Bundle
from specserve.engine.speculative.proposers.draft_model import DraftModelMode
from specserve.engine.speculative.proposers.eagle3 import Eagle3Mode
from specserve.engine.speculative.proposers.mode import HeadMode, LoadedProposer, ProposerMode
from specserve.engine.speculative.proposers.mtp import MtpMode
from specserve.engine.speculative.proposers.prompt_lookup import PromptLookupMode
from specserve.engine.speculative.proposers.shared_kv import SharedKvMode
from specserve.engine.speculative.proposers.suffix import SuffixMode

PROPOSER_MODES: dict[str, ProposerMode] = {spec.mode: spec for spec in (
    PromptLookupMode(), SuffixMode(), DraftModelMode(), MtpMode(), Eagle3Mode(), SharedKvMode())}
MODEL_MODES = tuple(mode for mode, spec in PROPOSER_MODES.items() if not spec.in_coordinator)
HEAD_MODES = tuple(mode for mode, spec in PROPOSER_MODES.items() if isinstance(spec, HeadMode))


def proposer_mode(mode: str) -> ProposerMode:
    try:
        return PROPOSER_MODES[mode]
    except KeyError:
        raise ModelLoadError(f"unknown proposer mode '{mode}' (known: {', '.join(PROPOSER_MODES)})") from None


def provided_modes(bundle: Bundle | None) -> list[str]:
    """Every mode a bundle can serve, target-only first."""
    return ["none", *(mode for mode, spec in PROPOSER_MODES.items() if spec.provided_by(bundle))]


def load_proposer(mode: str, bundle: Bundle, config: EngineConfig, target_vocab: int) -> LoadedProposer:
    return proposer_mode(mode).load(bundle, config, target_vocab)
