"""The in-process engine: the round coordinator over a local transport.

``Engine()`` serves the default model (SmolLM2-135M-Instruct, converted at install);
``Engine("models/fixture")`` a bundle with ``manifest.json``, ``Engine("models/fixture/target")``
a model directory (its parent's manifest, if any, names the draft and heads).

This is the embedded mode of the very scheduler the server runs (vLLM's in-process
client of one engine core): ``RoundCoordinator`` admits, batches and retires requests;
``LocalTransport`` hands its messages to a ``TargetWorker`` and ``ProposerWorker``s by
function call. The coordinator's loop lives on a background asyncio thread, so
``generate`` is synchronous and thread-safe, and concurrent callers share its batches.
"""
from __future__ import annotations

import asyncio
import atexit
import functools
import itertools
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from specserve.engine.assembly import coordination, model_modes, proposer_needs, proposer_worker, target_worker
from specserve.engine.config import EngineConfig
from specserve.engine.grammar.compiler import grammar_compiler
from specserve.engine.model.bundle import resolve_model_path
from specserve.engine.model.cached_decoder import CachedDecoder
from specserve.engine.model.chat import ChatTemplate
from specserve.engine.model.default_model import default_model_dir
from specserve.engine.model.tokenizer import TextTokenizer
from specserve.engine.options import GenerationOptions
from specserve.engine.sched.local_transport import LocalTransport
from specserve.engine.sched.metrics import RoundMetrics
from specserve.engine.sched.sequence_driver import SequenceDriver
from specserve.engine.speculative.proposers.base import Needs
from specserve.engine.speculative.proposers.registry import PROPOSER_MODES, LoadedProposer
from specserve.engine.speculative.sampling import TokenLogprob
from specserve.engine.speculative.sequence import FinishReason, TokenCallback, TokenEvent
from specserve.engine.speculative.stats import SpeculativeStats


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    logprobs: list[TokenLogprob] | None
    prefill_seconds: float   # from submission to the first token (admission wait included)
    decode_seconds: float    # from the first token until ``generate`` returned
    speculative: SpeculativeStats = field(default_factory=SpeculativeStats)
    prompt_logprobs: list[TokenLogprob] | None = None  # of prompt tokens 1.. (options.prompt_logprobs)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not computed)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        total = self.prefill_seconds + self.decode_seconds
        return self.completion_tokens / total if total > 0 else 0.0


class Engine:
    def __init__(self, model_dir: str | Path | None = None, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        target_dir, self.bundle = resolve_model_path(Path(model_dir) if model_dir is not None else default_model_dir())
        self.target = CachedDecoder(target_dir, config, owns_cores=True, graph_format=config.target_format)
        self.chat_template = ChatTemplate.from_model_dir(target_dir)
        where = f"the bundle at {self.bundle.directory}" if self.bundle else \
            f"{self.target.decoder.model_dir} (no manifest.json beside it)"
        vocab = self.target.decoder.vocab_size
        self.proposers: dict[str, LoadedProposer] = {mode: PROPOSER_MODES[mode].load(self.bundle, config, vocab)
                                                     for mode in model_modes(self.bundle, config, where)}
        self.needs: dict[str, Needs] = proposer_needs(self.bundle, self.proposers,
                                                      set(self.target.decoder.io.extra_outputs))
        self.metrics = RoundMetrics()
        target = self.target
        grammars = functools.partial(grammar_compiler, target.tokenizer, vocab,
                                     target.eos_token_ids)  # one per model: the target worker's too
        workers = {mode: proposer_worker(loaded, self.metrics, grammars) for mode, loaded in self.proposers.items()}
        self.transport = LocalTransport(target_worker(self.target, config), workers,
                                        config.scheduler.admission_timeout_s)
        self.factory, self.coordinator = coordination(self.transport, target.tokenizer, target.eos_token_ids,
                                                      target.max_context, vocab, config, self.needs, self.metrics)
        self.cumulative_stats: dict[str, SpeculativeStats] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None  # started on first use
        self._thread: threading.Thread | None = None

    @property
    def draft(self) -> CachedDecoder | None:
        """The draft model, if loaded (its KV pool is separate from the target's)."""
        loaded = self.proposers.get("draft_model")
        return loaded.model if loaded is not None else None

    @property
    def tokenizer(self) -> TextTokenizer:
        return self.target.tokenizer

    @property
    def available_modes(self) -> list[str]:
        return self.factory.modes

    @property
    def default_mode(self) -> str:
        return self.factory.default_mode

    # -- serving ---------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], options: GenerationOptions | None = None,
                 on_token: TokenCallback | None = None) -> GenerationResult:
        """Decode one request; concurrent calls from several threads are batched together.

        ``on_token`` runs on the engine's loop thread: keep it short. If it raises, the
        request is cancelled (its KV blocks freed) and the exception re-raised here.
        """
        options = options or GenerationOptions()
        driver, stamps = self._driver(prompt, options, on_token)
        started = time.perf_counter()
        asyncio.run_coroutine_threadsafe(self._run(driver), self._event_loop()).result()
        return self._result(driver, started, stamps, time.perf_counter())

    def chat(self, messages: Sequence[dict], options: GenerationOptions | None = None,
             on_token: TokenCallback | None = None) -> GenerationResult:
        """One assistant reply to ``messages`` (``[{"role": ..., "content": ...}]``), rendered
        with the model's chat template and ending in its generation prompt, as vLLM's
        ``LLM.chat`` and the server's ``/v1/chat/completions``."""
        return self.generate(self.chat_template.render(messages), options, on_token)

    async def _run(self, driver: SequenceDriver) -> None:
        try:
            await self.coordinator.run(driver)
        finally:
            with self._lock:
                self.cumulative_stats.setdefault(driver.mode, SpeculativeStats(mode=driver.mode)).merge(driver.stats)

    def _driver(self, prompt, options: GenerationOptions,
                on_token: TokenCallback | None) -> tuple[SequenceDriver, list[float]]:
        stamps: list[float] = []  # when each token was committed

        def stamped(event: TokenEvent) -> None:
            stamps.append(time.perf_counter())
            if on_token is not None:
                on_token(event)

        prompt_ids = self.factory.encode(prompt)
        return self.factory.create(next(self._ids), prompt_ids, options, stamped), stamps

    @staticmethod
    def _result(driver: SequenceDriver, started: float, stamps: list[float], returned: float) -> GenerationResult:
        state = driver.state
        first = stamps[0] if stamps else returned
        return GenerationResult(text=state.text, token_ids=state.generated, finish_reason=state.finish_reason,
                                prompt_tokens=state.prompt_len,
                                logprobs=state.logprobs if state.options.logprobs else None,
                                prefill_seconds=first - started, decode_seconds=returned - first,
                                speculative=driver.stats, prompt_logprobs=state.prompt_logprobs,
                                cached_tokens=driver.cached_tokens)

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=loop.run_forever, name="specserve-engine", daemon=True)
                self._thread.start()
                self._loop = loop
                atexit.register(self.close)  # stop the coordinator's tasks before the interpreter tears down
            return self._loop

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's ``reset_prefix_cache``), so the next requests
        run cold: for benchmarks. Running requests keep the blocks they share. Returns the
        target's cached blocks freed."""
        return asyncio.run_coroutine_threadsafe(self.transport.reset_prefix_cache(), self._event_loop()).result()

    def reset_suffix_cache(self) -> int:
        """Forget earlier requests' outputs, which suffix decoding drafts from, so the next
        requests run cold: for benchmarks. Returns how many outputs it held."""
        async def reset() -> int:  # on the coordinator's loop, between its ticks
            return self.factory.reset_suffix_cache()
        return asyncio.run_coroutine_threadsafe(reset(), self._event_loop()).result()

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until retired requests' blocks are all back (the release rides on the next
        tick); False on timeout. For tests and graceful shutdown."""
        if self._loop is None:
            return True
        return asyncio.run_coroutine_threadsafe(self.coordinator.drain(timeout_s), self._loop).result()

    def close(self, timeout_s: float = 10.0) -> None:
        """Cancel the coordinator's tasks and stop the loop thread. Requests still running
        fail; the engine cannot be used afterwards. Idempotent."""
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is None:
            return
        atexit.unregister(self.close)

        async def cancel_tasks() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel_tasks(), loop).result(timeout_s)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout_s)
            if not self._thread.is_alive():
                loop.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
