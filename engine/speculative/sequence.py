"""One request's committed output: the single path every generated token goes through.

Target-only decoding and speculative rounds both commit tokens here one at a time, so
EOS, stop strings, ``max_new_tokens``, the context limit, streaming and logprobs behave
identically whichever way a token was produced.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from specserve.engine.options import GenerationOptions
from specserve.engine.speculative.sampling import SequenceRules, TokenLogprob
from specserve.engine.model.tokenizer import TextTokenizer

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class TokenEvent:
    """What a streaming callback receives after each committed token.

    ``text`` is the newly safe text (may be empty while a multi-byte character or a
    possible stop-string prefix is held back); ``finish_reason`` is set on the last event.
    """

    token_id: int
    text: str
    logprob: TokenLogprob | None
    finish_reason: FinishReason | None


TokenCallback = Callable[[TokenEvent], None]


class SequenceState:
    def __init__(self, prompt_ids: Sequence[int], options: GenerationOptions, tokenizer: TextTokenizer,
                 eos_token_ids: Sequence[int], max_context: int, on_token: TokenCallback | None = None) -> None:
        self.options = options
        self.tokens: list[int] = list(prompt_ids)
        self.prompt_len = len(self.tokens)
        self.max_context = max_context
        # for every logit processing; its end tokens (EOS unless ignored, and stop_token_ids,
        # which end as EOS does, ignore_eos or not) are also what ends the sequence here
        self.rules = SequenceRules.of(self.prompt_len, options, eos_token_ids)
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob] | None = None  # of prompt tokens 1.., if asked for
        self.finish_reason: FinishReason | None = None
        self._decoder = tokenizer.stream()
        self._on_token = on_token
        self._text = ""       # all decoded text so far (may run past a stop string)
        self._emitted = 0     # characters of _text already handed to the callback
        self._holdback = max((len(s) for s in options.stop), default=1) - 1
        self._boundary = 0  # text of the first min_tokens tokens: a stop string must end past it

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def text(self) -> str:
        """The output text so far (final once finished; stop strings excluded)."""
        return self._text[: self._emitted] if self.finish_reason else self._text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def commit(self, token_id: int, logprob: TokenLogprob | None = None) -> bool:
        """Append one token; returns True when the sequence has finished."""
        if self.finished:
            raise RuntimeError("commit after finish")
        self.tokens.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)
        if token_id in self.rules.end_tokens:
            self.finish_reason = "stop"  # the token is kept, its text is not (vLLM's default)
            self._text += self._decoder.flush()
            stop_at = self._find_stop()  # the flushed tail may complete a stop string
            self._emit(token_id, logprob, len(self._text) if stop_at is None else stop_at)
            return True
        self._text += self._decoder.push(token_id)
        stop_at = self._find_stop()
        if stop_at is not None:
            self.finish_reason = "stop"
            self._emit(token_id, logprob, stop_at)
            return True
        if len(self.tokens) - self.prompt_len >= self.options.max_new_tokens or len(self.tokens) >= self.max_context:
            self._text += self._decoder.flush()
            stop_at = self._find_stop()  # the flushed tail may complete a stop string
            self.finish_reason = "length" if stop_at is None else "stop"
            self._emit(token_id, logprob, len(self._text) if stop_at is None else stop_at)
            return True
        self._emit(token_id, logprob, max(self._emitted, len(self._text) - self._holdback))
        return False

    def _find_stop(self) -> int | None:
        """Earliest stop-string match in text not yet emitted (matches may straddle tokens).
        With ``min_tokens``, vLLM's (V1) rule: none is looked for until more than that many
        tokens are generated, and a match must end in the text after theirs (it may begin
        up to its own length - 1 characters before)."""
        if self.options.min_tokens and len(self.tokens) - self.prompt_len <= self.options.min_tokens:
            self._boundary = len(self._text)
            return None
        floor = max(0, self._emitted - self._holdback)
        hits = [i for i in (self._text.find(s, max(floor, self._boundary - len(s) + 1)) for s in self.options.stop)
                if i >= 0]
        return min(hits) if hits else None

    def _emit(self, token_id: int, logprob: TokenLogprob | None, upto: int) -> None:
        delta = self._text[self._emitted : upto]
        self._emitted = max(self._emitted, upto)
        if self._on_token is not None:
            self._on_token(TokenEvent(token_id, delta, logprob, self.finish_reason))
