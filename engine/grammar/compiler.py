"""Compiling grammars for one model: llguidance's view of its vocabulary, built once,
and one compiled matcher per grammar, kept, so a schema is compiled once and every
sequence constrained by it starts from a copy.

llguidance reads the vocabulary as each token's bytes (``TextTokenizer.token_bytes``:
byte-level BPE, byte fallback and word-level vocabularies alike), the model's special
tokens (never matched as text, so a grammar cannot spell ``<|im_end|>`` inside a string)
and its end-of-sequence tokens, which a grammar allows exactly where its output is
complete. The logits' width, not the tokenizer's, is the vocabulary: ids past the
tokenizer's are never allowed.
"""
from __future__ import annotations

import re
import threading
import weakref
from collections import OrderedDict
from typing import Sequence

from specserve.engine.errors import InvalidRequestError
from specserve.engine.grammar.spec import StructuredOutput
from specserve.engine.grammar.state import GrammarState
from specserve.engine.model.tokenizer import TextTokenizer

CACHED_GRAMMARS = 128  # compiled matchers kept per model (a least-recently-used cache)


class _Vocabulary:
    """What ``llguidance.TokenizerWrapper`` reads from a tokenizer."""

    def __init__(self, tokenizer: TextTokenizer, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else 0
        self.bos_token_id = None
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = tokenizer.special_token_ids

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # llguidance probes with bytes once; strings are what it then sends
            raise TypeError("text only")
        return self._tokenizer.encode(text)


class GrammarCompiler:
    """One model's grammars. Thread-safe: the router's and the target's threads share one
    in-process."""

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = CACHED_GRAMMARS) -> None:
        import llguidance

        self.vocab_size = vocab_size
        self._llg = llguidance
        self._tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tokenizer, eos_token_ids)),
                                                 n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compilations = 0  # grammars compiled so far (each once while it stays cached)

    def check(self, spec: StructuredOutput) -> None:
        """Raise ``InvalidRequestError`` naming what is wrong with ``spec`` (a bad schema, an
        unsupported keyword, a regex or grammar that does not parse); compiles it once."""
        self._template(spec)

    def start(self, spec: StructuredOutput) -> GrammarState:
        """A sequence's grammar state at the start of its output."""
        return GrammarState(self._template(spec).deep_copy(), self.vocab_size)

    def _template(self, spec: StructuredOutput):
        try:
            grammar = spec.to_llguidance()
        except ValueError as exc:
            raise InvalidRequestError(f"{spec.kind}: {exc}", param="structured_output") from None
        with self._lock:
            matcher = self._compiled.get(grammar)
            if matcher is not None:
                self._compiled.move_to_end(grammar)
                return matcher
        matcher = self._llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{spec.kind}: {_message(matcher.get_error())}", param="structured_output")
        with self._lock:
            self.compilations += 1
            self._compiled[grammar] = matcher
            while len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        return matcher


def _message(error: str) -> str:
    """llguidance's message on one line, without the source excerpt and caret it draws
    under the fault ("   1 | start: /a(b/", "      ^")."""
    lines = [line.strip() for line in error.splitlines()]
    kept = [line for line in lines if line and set(line) != {"^"} and not re.match(r"\d+ \|", line)]
    return " ".join(kept) or "the grammar does not compile"


_COMPILERS: "weakref.WeakKeyDictionary[TextTokenizer, dict[tuple, GrammarCompiler]]" = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()


def grammar_compiler(tokenizer: TextTokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> GrammarCompiler:
    """The model's compiler, made on first use (llguidance reads the whole vocabulary:
    ~0.15 s for SmolLM2's 49 152 tokens) and shared by everything in the process that
    decodes with this tokenizer: the in-process engine's request checks and its target
    worker compile each schema once between them."""
    key = (vocab_size, tuple(eos_token_ids))
    with _COMPILERS_LOCK:
        compilers = _COMPILERS.setdefault(tokenizer, {})
        if key not in compilers:
            compilers[key] = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        return compilers[key]
