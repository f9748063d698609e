"""OpenAI-compatible response bodies and server-sent-event chunks, built from what the
engine committed for a request (its ``SequenceState``, ``SpeculativeStats`` and
``TokenEvent``s). The router only runs the request; everything the client reads is
shaped here, next to the request models in ``openai_protocol.py``.

Every response carries the request's speculative statistics under ``speculative``; with
``return_token_ids`` each choice (and each streamed chunk) carries ``token_ids``.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Callable, Sequence

from engine.sched.sequence_driver import SequenceDriver
from engine.spec.sampling import TokenLogprob
from engine.spec.sequence import TokenEvent
from engine.spec.stats import SpeculativeStats

from .openai_protocol import ApiError

SSE_DONE = "data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def speculative_body(stats: SpeculativeStats, num_speculative_tokens: int) -> dict:
    return {"mode": stats.mode, "num_speculative_tokens": num_speculative_tokens,
            "rounds": stats.verification_steps, "draft_tokens": stats.proposed_tokens,
            "accepted_tokens": stats.accepted_tokens, "acceptance_rate": round(stats.acceptance_rate, 4),
            "mean_accepted_length": round(stats.mean_accepted_length, 4),
            "accepted_per_position": list(stats.accepted_per_position),
            "draft_per_position": list(stats.proposed_per_position)}


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(items: Sequence[TokenLogprob], offset: int = 0) -> dict:
    """The legacy completions format: parallel lists."""
    offsets, position = [], offset
    for item in items:
        offsets.append(position)
        position += len(item.token)
    # As OpenAI's (and vLLM's): each position's top_logprobs holds the chosen token too,
    # so up to logprobs + 1 entries, and {chosen: logprob} with logprobs=0.
    return {"tokens": [i.token for i in items], "token_logprobs": [i.logprob for i in items],
            "top_logprobs": [{**{t.token: t.logprob for t in i.top}, i.token: i.logprob} for i in items],
            "text_offset": offsets}


def chat_logprobs(items: Sequence[TokenLogprob], token_bytes: Callable[[int], bytes] | None = None) -> dict:
    """Chat's format; ``bytes`` are the token's own bytes where ``token_bytes`` knows them
    (a token holding part of a character has text U+FFFD, but real bytes)."""
    def entry(token_id: int, token: str, logprob: float) -> dict:
        raw = token_bytes(token_id) if token_bytes is not None else token.encode("utf-8")
        return {"token": token, "logprob": logprob, "bytes": list(raw)}
    return {"content": [{**entry(i.token_id, i.token, i.logprob),
                         "top_logprobs": [entry(t.token_id, t.token, t.logprob) for t in i.top]} for i in items]}


class ResponseShaper:
    """One request's response: the whole body (``full``), or its stream (``opening``,
    ``tokens`` per round, then ``closing`` or ``error``, then ``SSE_DONE``)."""

    def __init__(self, model_name: str, chat: bool, token_ids: bool = False, include_usage: bool = False,
                 token_bytes: Callable[[int], bytes] | None = None) -> None:
        self.model_name, self.chat, self.token_ids, self.include_usage = model_name, chat, token_ids, include_usage
        self.token_bytes = token_bytes
        self.id, self.created = new_id("chatcmpl" if chat else "cmpl"), now()
        self._offset = 0  # token text streamed so far (completion logprobs' text_offset)

    # -- whole response ------------------------------------------------------------------
    def full(self, driver: SequenceDriver) -> dict:
        state = driver.state
        logprobs = state.logprobs if state.options.logprobs else None
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": state.text},
                      "finish_reason": state.finish_reason,
                      "logprobs": chat_logprobs(logprobs, self.token_bytes) if logprobs is not None else None}
        else:
            choice = {"index": 0, "text": state.text, "finish_reason": state.finish_reason,
                      "logprobs": completion_logprobs(logprobs) if logprobs is not None else None}
        if self.token_ids:
            choice["token_ids"] = list(state.generated)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model_name, "choices": [choice],
                "usage": usage_body(state.prompt_len, len(state.generated)),
                "speculative": speculative_body(driver.stats, driver.num_drafts)}

    # -- stream --------------------------------------------------------------------------
    def _chunk(self, choices: list, **extra) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        if self.include_usage:
            extra.setdefault("usage", None)  # OpenAI's: null on every chunk but the usage one
        return "data: " + json.dumps({"id": self.id, "object": kind, "created": self.created,
                                      "model": self.model_name, "choices": choices, **extra}) + "\n\n"

    def opening(self) -> str:
        """What a stream starts with: chat announces the assistant role; completions nothing."""
        if not self.chat:
            return ""
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])

    def tokens(self, events: Sequence[TokenEvent], driver: SequenceDriver) -> str:
        """One chunk per committed token, concatenated: a round's tokens go out as one write.
        The last token's chunk (the one with ``finish_reason``) also carries the speculative
        statistics: the request has finished, so they are final."""
        parts = []
        for event in events:
            extra = {"speculative": speculative_body(driver.stats, driver.num_drafts)} if event.finish_reason else {}
            logprobs = None
            if event.logprob is not None:
                logprobs = (chat_logprobs([event.logprob], self.token_bytes) if self.chat
                            else completion_logprobs([event.logprob], self._offset))
                # text_offset counts token texts, as the whole response's does: a stream's
                # text may lag its tokens (a possible stop string held back)
                self._offset += len(event.logprob.token)
            ids = {"token_ids": [event.token_id]} if self.token_ids else {}
            if self.chat:
                delta = {"content": event.text} if event.text else {}
                parts.append(self._chunk([{"index": 0, "delta": delta, "logprobs": logprobs,
                                           "finish_reason": event.finish_reason, **ids}], **extra))
            else:
                parts.append(self._chunk([{"index": 0, "text": event.text, "logprobs": logprobs,
                                           "finish_reason": event.finish_reason, **ids}], **extra))
        return "".join(parts)

    def closing(self, driver: SequenceDriver) -> str:
        """After the last token: the usage chunk (empty ``choices``) if the client asked for
        it with ``stream_options.include_usage``, as OpenAI sends it; else nothing (a client
        reading ``chunk.choices[0]`` must never meet an empty chunk it did not ask for)."""
        if not self.include_usage:
            return ""
        state = driver.state
        return self._chunk([], usage=usage_body(state.prompt_len, len(state.generated)))

    @staticmethod
    def error(error: ApiError) -> str:
        """A failure after the stream started: an OpenAI error object as the last event."""
        return "data: " + json.dumps(error.body()) + "\n\n"
