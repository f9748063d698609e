"""The in-process engine: one target, the proposers the bundle provides, ``generate``.

``Engine("models")`` (a bundle with ``manifest.json``) or ``Engine("models/target")``
(a model directory; its parent's manifest, if any, names the draft and heads).
Every request runs the same rounds (``rounds.SequenceRounds``) through the continuous
batching scheduler; ``mode="none"`` is plain target-only decoding, the reference every
other mode must reproduce.
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from engine.sched.batching import BatchEngineLoop, BatchScheduler, Job
from engine.model.cached_decoder import CachedDecoder
from engine.errors import InvalidRequestError, ModelLoadError
from engine.model.heads import HeadModel
from engine.model.manifest import MANIFEST_NAME, BundleManifest
from engine.options import SPECULATIVE_MODES, EngineConfig, GenerationOptions
from engine.spec.proposers.registry import (HEAD_MODES, MODEL_MODES, head_needs, head_proposer_factory, load_draft,
                               load_head_model)
from engine.spec.proposers.base import Needs, Proposer
from engine.spec.proposers.draft_model import DraftModelProposer
from engine.spec.proposers.prompt_lookup import PromptLookupProposer
from engine.spec.rounds import NO_NEEDS, SequenceRounds
from engine.spec.sampling import TokenLogprob
from engine.spec.sequence import FinishReason, SequenceState, TokenCallback
from engine.spec.stats import SpeculativeStats
from engine.model.tokenizer import TextTokenizer

# A verify pass lets draft i see window + i keys and evicts before rejected drafts are
# rewound, so speculation under a sliding window could change the output: refuse it.
_WINDOW_REFUSAL = ("speculative decoding needs a full-attention KV cache to stay lossless; this engine has "
                   "sliding_window set, so only speculative_mode 'none' is available")


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    logprobs: list[TokenLogprob] | None
    prefill_seconds: float
    decode_seconds: float
    speculative: SpeculativeStats = field(default_factory=SpeculativeStats)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        total = self.prefill_seconds + self.decode_seconds
        return self.completion_tokens / total if total > 0 else 0.0


def _resolve_bundle(path: Path) -> tuple[Path, Path | None, BundleManifest | None]:
    """(target dir, bundle dir, manifest) for a bundle dir or a model dir inside one."""
    if (path / MANIFEST_NAME).is_file():
        manifest = BundleManifest.load(path)
        return path / manifest.models["target"].directory, path, manifest
    if (path.parent / MANIFEST_NAME).is_file():
        manifest = BundleManifest.load(path.parent)
        if manifest.models.get("target") and (path.parent / manifest.models["target"].directory).resolve() == path.resolve():
            return path, path.parent, manifest
    return path, None, None


class Engine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        target_dir, self.bundle_dir, self.manifest = _resolve_bundle(Path(model_dir))
        self.target = CachedDecoder(target_dir, self.config)
        self.draft: CachedDecoder | None = None
        self.heads: dict[str, HeadModel] = {}
        self._factories: dict[str, Callable[[int], Proposer | None]] = {
            "none": lambda k: None,
            "prompt_lookup": lambda k: PromptLookupProposer(self.config.speculative.prompt_lookup_ngram, k),
        }
        self.needs: dict[str, Needs] = {}  # what each head mode takes from the target
        self._load_proposers()
        default = self.config.speculative.default_mode
        if default not in self._factories:
            raise ModelLoadError(f"default speculative mode '{default}' is not available "
                                 f"(loaded: {', '.join(self.available_modes)})")
        if default != "none" and self.config.sliding_window is not None:
            raise ModelLoadError(_WINDOW_REFUSAL)
        self.cumulative_stats: dict[str, SpeculativeStats] = {}
        self._seq_ids = itertools.count()
        self._lock = threading.Lock()
        self._loop: BatchEngineLoop | None = None  # started on first use

    # -- loading ---------------------------------------------------------------------------
    def _wanted(self, mode: str) -> bool:
        load = self.config.speculative.load
        return load is None or mode in load

    def _load_proposers(self) -> None:
        load = self.config.speculative.load or ()
        if self.manifest is None:
            needs_bundle = [m for m in load if m in MODEL_MODES]
            if needs_bundle:
                raise ModelLoadError(f"speculative modes {needs_bundle} need a model bundle with {MANIFEST_NAME}; "
                                     f"none found next to {self.target.decoder.model_dir}")
            return
        vocab = self.target.decoder.vocab_size
        if self._wanted("draft_model") and "draft" in self.manifest.models:
            self.draft = load_draft(self.bundle_dir, self.manifest, self.config, vocab)
            self._factories["draft_model"] = lambda k: DraftModelProposer(self.draft)
        final = self.manifest.models["target"].hidden_outputs.final
        outputs = set(self.target.decoder.io.extra_outputs)
        for kind in HEAD_MODES:
            if kind not in self.manifest.heads or not self._wanted(kind):
                continue
            head = load_head_model(kind, self.bundle_dir, self.manifest, self.config, vocab)
            self.needs[kind] = head_needs(kind, head.config, final, outputs)
            self.heads[kind] = head
            make = head_proposer_factory(kind, head, self.config)
            self._factories[kind] = lambda k, make=make: make()
        missing = [m for m in load if m not in self._factories]
        if missing:
            raise ModelLoadError(f"speculative modes {missing} requested but the bundle at {self.bundle_dir} "
                                 f"does not provide them")

    # -- serving ---------------------------------------------------------------------------
    @property
    def tokenizer(self) -> TextTokenizer:
        return self.target.tokenizer

    @property
    def available_modes(self) -> list[str]:
        return [m for m in SPECULATIVE_MODES if m in self._factories]

    def resolve_mode(self, options: GenerationOptions) -> tuple[str, int]:
        mode = options.speculative_mode or self.config.speculative.default_mode
        if mode != "none" and self.config.sliding_window is not None:
            raise InvalidRequestError(_WINDOW_REFUSAL)
        if mode not in self._factories:
            raise InvalidRequestError(f"speculative mode '{mode}' is not loaded in this engine "
                                      f"(available: {', '.join(self.available_modes)})")
        return mode, options.num_speculative_tokens or self.config.speculative.num_speculative_tokens

    def generate(self, prompt: str | Sequence[int], options: GenerationOptions | None = None,
                 on_token: TokenCallback | None = None) -> GenerationResult:
        """Decode one request; concurrent calls from several threads are batched together.

        ``on_token`` runs on the engine's batching thread: keep it short.
        """
        options = options or GenerationOptions()
        mode, k = self.resolve_mode(options)
        target = self.target
        prompt_ids = target.encode_prompt(prompt)
        state = SequenceState(prompt_ids, options, target.tokenizer, target.eos_token_ids, target.max_context, on_token)
        stats = SpeculativeStats(mode=mode)

        def start() -> SequenceRounds:
            proposer = self._factories[mode](k)
            seq_id = next(self._seq_ids)
            try:
                target.cache.add_sequence(seq_id)
            except Exception:
                if proposer is not None:
                    proposer.close()
                raise
            return SequenceRounds(target, seq_id, state, proposer, k, np.random.default_rng(options.seed), stats,
                                  self.needs.get(mode, NO_NEEDS))

        def finish(rounds: SequenceRounds) -> None:
            try:
                target.cache.free(rounds.seq_id)
            finally:
                if rounds.proposer is not None:
                    rounds.proposer.close()
            with self._lock:
                self.cumulative_stats.setdefault(mode, SpeculativeStats(mode=mode)).merge(stats)

        job = Job(start, finish, prompt_len=len(prompt_ids))
        started = time.perf_counter()
        self._batch_loop().submit(job)
        job.done.wait()
        elapsed = time.perf_counter() - started
        if job.error is not None:
            raise job.error
        prefill = job.rounds.prefill_seconds
        return GenerationResult(text=state.text, token_ids=state.generated, finish_reason=state.finish_reason,
                                prompt_tokens=state.prompt_len, logprobs=state.logprobs if options.logprobs else None,
                                prefill_seconds=prefill, decode_seconds=elapsed - prefill, speculative=stats)

    def _batch_loop(self) -> BatchEngineLoop:
        with self._lock:
            if self._loop is None:
                self._loop = BatchEngineLoop(BatchScheduler(self.target, self.config.max_batch_size))
            return self._loop
