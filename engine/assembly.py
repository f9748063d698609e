"""How a runnable engine is put together from a bundle and an ``EngineConfig``, once for
both transports.

The in-process ``Engine`` builds every part here in one process. On the server the same
parts are built where they run: the Serve builder asks which proposer modes to deploy
(``model_modes``), each target worker and proposer worker builds its own worker
(``target_worker``, ``proposer_worker``), and each router wires the coordinator from what
the target reports (``proposer_needs``, ``coordination``). A new
proposer mode or option is wired here and in the registry, nowhere else.
"""
from __future__ import annotations

from typing import Callable, Iterable

from specserve.engine.config import EngineConfig
from specserve.engine.errors import ModelLoadError
from specserve.engine.grammar.compiler import GrammarCompiler
from specserve.engine.model.bundle import Bundle
from specserve.engine.model.cached_decoder import CachedDecoder
from specserve.engine.model.tokenizer import TextTokenizer
from specserve.engine.sched.coordinator import RoundCoordinator, Transport
from specserve.engine.sched.metrics import RoundMetrics
from specserve.engine.sched.proposer_worker import IDLE_TIMEOUT_S, ProposerWorker
from specserve.engine.sched.sequence_driver import DriverFactory
from specserve.engine.sched.target_worker import TargetWorker
from specserve.engine.speculative.proposers.base import Needs
from specserve.engine.speculative.proposers.mode import LoadedProposer
from specserve.engine.speculative.proposers.registry import MODEL_MODES, PROPOSER_MODES, provided_modes

def model_modes(bundle: Bundle | None, config: EngineConfig, where: str) -> list[str]:
    """The proposer modes with a model of their own to load (in-process) or deploy
    (server): ``speculative.load``, or every one the bundle provides. Raises
    ``ModelLoadError`` for a requested mode that ``where`` (the bundle) lacks."""
    available = provided_modes(bundle)
    load = config.speculative.load
    missing = [mode for mode in load or () if mode not in available]
    if missing:
        raise ModelLoadError(f"speculative modes {missing} requested but {where} does not provide them")
    return [mode for mode in MODEL_MODES if mode in available and (load is None or mode in load)]


def proposer_needs(bundle: Bundle | None, modes: Iterable[str], target_outputs: set[str]) -> dict[str, Needs]:
    """What each proposer mode takes from the target, checked against the target's outputs."""
    return {mode: PROPOSER_MODES[mode].needs(bundle, target_outputs) for mode in modes}


def target_worker(decoder: CachedDecoder, config: EngineConfig, grammars_now: bool = False) -> TargetWorker:
    """The target's half of every round, ready to serve: its verify passes timed
    (adaptive speculation plans with them; it also warms onnxruntime up, so the first
    request's speed is the engine's own), and with ``grammars_now`` the vocabulary read
    for grammars (a server does it at start-up, not in a constrained request's tick)."""
    worker = TargetWorker(decoder)
    if grammars_now:
        worker.grammars()
    worker.verify_costs(config.scheduler.max_batch_size)
    return worker


def proposer_worker(loaded: LoadedProposer, metrics: RoundMetrics | None = None,
                    grammars: Callable[[], GrammarCompiler] | None = None, grammars_now: bool = False,
                    idle_timeout_s: float = IDLE_TIMEOUT_S) -> ProposerWorker:
    """One proposer mode's worker, ready to serve: its model probed (a first real run,
    which also warms its session up), its draft costs timed, and with ``grammars_now``
    the target's grammar compiler made (``grammars``: drafts follow grammars)."""
    worker = ProposerWorker(loaded, metrics, idle_timeout_s=idle_timeout_s, grammars=grammars)
    if grammars_now:
        worker.grammars()
    worker.probe()
    worker.draft_costs()
    return worker


def coordination(transport: Transport, tokenizer: TextTokenizer, eos_token_ids, max_context: int,
                 vocab_size: int, config: EngineConfig, needs: dict[str, Needs],
                 metrics: RoundMetrics) -> tuple[DriverFactory, RoundCoordinator]:
    """What turns requests into rounds over ``transport``: the factory of each request's
    sequence driver and the round coordinator."""
    factory = DriverFactory(tokenizer, eos_token_ids, max_context, vocab_size, config, needs)
    return factory, RoundCoordinator(transport, config.scheduler, metrics)
