"""The one registry of proposer kinds: each speculative mode's name, mapped to its kind
(``kind.ProposerKind``), which says how its proposers are made, what it takes from the
target, how its drafts are timed and which Serve deployment hosts it.

Everything that needs to know about a kind asks here -- the in-process ``Engine``, the
sequence driver (which kinds run inside the coordinator), the proposer replicas
(loading), the router (wiring ``Needs``) and the Serve builder (deployment names) --
so adding a kind is its class beside its proposer and one entry here.
"""
from __future__ import annotations

from specserve.engine.config import EngineConfig
from specserve.engine.errors import ModelLoadError
from specserve.engine.model.bundle import Bundle
from specserve.engine.speculative.proposers.draft_model import DraftModelKind
from specserve.engine.speculative.proposers.eagle3 import Eagle3Kind
from specserve.engine.speculative.proposers.kind import HeadKind, LoadedProposer, ProposerKind
from specserve.engine.speculative.proposers.mtp import MtpKind
from specserve.engine.speculative.proposers.prompt_lookup import PromptLookupKind
from specserve.engine.speculative.proposers.shared_kv import SharedKvKind
from specserve.engine.speculative.proposers.suffix import SuffixKind

PROPOSER_KINDS: dict[str, ProposerKind] = {kind.mode: kind for kind in (
    PromptLookupKind(), SuffixKind(), DraftModelKind(), MtpKind(), Eagle3Kind(), SharedKvKind())}
MODEL_MODES = tuple(mode for mode, kind in PROPOSER_KINDS.items() if not kind.in_coordinator)
HEAD_MODES = tuple(mode for mode, kind in PROPOSER_KINDS.items() if isinstance(kind, HeadKind))


def proposer_kind(mode: str) -> ProposerKind:
    try:
        return PROPOSER_KINDS[mode]
    except KeyError:
        raise ModelLoadError(f"unknown proposer kind '{mode}' (known: {', '.join(PROPOSER_KINDS)})") from None


def provided_modes(bundle: Bundle | None) -> list[str]:
    """Every mode a bundle can serve, target-only first."""
    return ["none", *(mode for mode, kind in PROPOSER_KINDS.items() if kind.provided_by(bundle))]


def load_proposer(mode: str, bundle: Bundle, config: EngineConfig, target_vocab: int) -> LoadedProposer:
    return proposer_kind(mode).load(bundle, config, target_vocab)
