"""OpenAI-compatible response bodies and server-sent-event chunks, built from what the
engine committed for a request (its ``SequenceState``, ``SpeculativeStats`` and
``TokenEvent``s). The router only runs the request; everything the client reads is
shaped here, next to the request models in ``openai_protocol.py``. A forced tool call's
output is read as ``tool_calls`` (``tool_calls.ToolPlan.scanner``), whole or as stream deltas.

Every response carries the request's speculative statistics under ``speculative`` (over
all its choices; a streamed choice's finishing chunk carries that choice's); with
``return_token_ids`` each choice (and each streamed chunk) carries ``token_ids``. A
request with ``n`` choices runs ``n`` sequences, one per choice index.
"""
from __future__ import annotations

import copy
import json
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Sequence

from specserve.engine.sched.sequence_driver import SequenceDriver
from specserve.engine.speculative.sampling import TokenLogprob
from specserve.engine.speculative.sequence import TokenEvent
from specserve.engine.speculative.stats import SpeculativeStats

from .openai_protocol import ApiError
from .tool_calls import CallScanner, ToolPlan

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
            "draft_per_position": list(stats.proposed_per_position),
            "lookups": stats.lookups, "lookup_hit_rate": round(stats.hit_rate, 4)}


@dataclass(frozen=True)
class ChoiceEvent:
    """A committed token of one of a request's choices, as the stream queues it."""

    index: int
    event: TokenEvent

    @property
    def finish_reason(self) -> str | None:  # what ``streaming.token_writes`` looks at
        return self.event.finish_reason


@dataclass(frozen=True)
class Echo:
    """A completions prompt echoed before its choices' text (``echo``): its text, and its
    first token's, which has no logprob (nothing comes before it)."""

    text: str
    first_token: str


def merged_stats(drivers: Sequence[SequenceDriver]) -> SpeculativeStats:
    """The request's speculative statistics over all its choices."""
    total = copy.deepcopy(drivers[0].stats)
    for driver in drivers[1:]:
        total.merge(driver.stats)
    return total


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's ``usage``; ``prompt_tokens_details.cached_tokens``: the prompt tokens whose
    KV came from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_logprobs(items: Sequence[TokenLogprob], offset: int = 0, first: str | None = None) -> dict:
    """The legacy completions format: parallel lists; ``first``, an echoed prompt's first
    token, leads them with null logprobs (OpenAI's and vLLM's shape)."""
    tokens = ([first] if first is not None else []) + [i.token for i in items]
    offsets, position = [], offset
    for token in tokens:
        offsets.append(position)
        position += len(token)
    lead = [None] if first is not None else []
    # As OpenAI's (and vLLM's): each position's top_logprobs holds the chosen token too,
    # so up to logprobs + 1 entries, and {chosen: logprob} with logprobs=0.
    return {"tokens": tokens, "token_logprobs": lead + [i.logprob for i in items],
            "top_logprobs": lead + [{**{t.token: t.logprob for t in i.top}, i.token: i.logprob} for i in items],
            "text_offset": offsets}


def chat_logprobs(items: Sequence[TokenLogprob], token_bytes: Callable[[int], bytes] | None = None) -> dict:
    """Chat's format; ``bytes`` are the token's own bytes where ``token_bytes`` knows them
    (a token holding part of a character has text U+FFFD, but real bytes)."""
    def entry(token_id: int, token: str, logprob: float) -> dict:
        raw = token_bytes(token_id) if token_bytes is not None else token.encode("utf-8")
        return {"token": token, "logprob": logprob, "bytes": list(raw)}
    return {"content": [{**entry(i.token_id, i.token, i.logprob),
                         "top_logprobs": [entry(t.token_id, t.token, t.logprob) for t in i.top]} for i in items]}


def _tool_finish(state, calls) -> str | None:
    """``"tool_calls"`` when the output holds calls and its grammar completed (it ended on
    an end-of-sequence token); else the sequence's own reason (``"length"``: the calls
    are cut short)."""
    ended = state.finish_reason == "stop" and state.generated and state.generated[-1] in state.rules.end_tokens
    return "tool_calls" if calls and ended else state.finish_reason


class ResponseShaper:
    """One request's response: the whole body (``full``), or its stream (``opening``,
    ``tokens`` per round, then ``closing`` or ``error``, then ``SSE_DONE``)."""

    def __init__(self, model_name: str, chat: bool, token_ids: bool = False, include_usage: bool = False,
                 token_bytes: Callable[[int], bytes] | None = None, choices_per_prompt: int = 1,
                 echoes: Sequence[Echo] | None = None, continuous_usage: bool = False,
                 tools: ToolPlan | None = None, event_per_token: bool = False) -> None:
        self.model_name, self.chat, self.token_ids, self.include_usage = model_name, chat, token_ids, include_usage
        self.tools = tools  # tools: the output is read as tool_calls, or as an auto reply
        self._scanners: dict[int, CallScanner] = {}  # per streamed choice
        self.token_bytes = token_bytes
        self.per_prompt = choices_per_prompt  # n: choice i answers prompt i // n
        self.echoes = echoes
        self.continuous_usage = include_usage and continuous_usage  # vLLM's continuous_usage_stats
        self.event_per_token = event_per_token  # ``stream_events: token``: one chunk per token
        self._prompt_tokens = self._streamed = self._cached = 0  # for it: prompts', streamed and cached tokens
        self.id, self.created = new_id("chatcmpl" if chat else "cmpl"), now()
        self._offsets: dict[int, int] = {}  # per choice, token text streamed so far (text_offset)
        self._started: set[int] = set()  # choices that have had a chunk

    # -- whole response ------------------------------------------------------------------
    def full(self, drivers: Sequence[SequenceDriver]) -> dict:
        choices = []
        for index, driver in enumerate(drivers):
            state = driver.state
            logprobs = state.logprobs if state.options.logprobs else None
            if self.chat:
                message, finish = {"role": "assistant", "content": state.text}, state.finish_reason
                if self.tools is not None:
                    scanner = self.tools.scanner()
                    scanner.feed(state.text)
                    message = scanner.message()
                    finish = _tool_finish(state, message.get("tool_calls"))
                choice = {"index": index, "message": message, "finish_reason": finish,
                          "logprobs": chat_logprobs(logprobs, self.token_bytes) if logprobs is not None else None}
            else:
                echo = self.echoes[index // self.per_prompt] if self.echoes else None
                if echo is not None and logprobs is not None:
                    logprobs = [*(state.prompt_logprobs or ()), *logprobs]
                choice = {"index": index, "text": (echo.text if echo else "") + state.text,
                          "finish_reason": state.finish_reason,
                          "logprobs": completion_logprobs(logprobs, first=echo and echo.first_token)
                          if logprobs is not None else None}
            if self.token_ids:  # vLLM's return_token_ids: the prompt's too
                choice["token_ids"], choice["prompt_token_ids"] = list(state.generated), state.tokens[: state.prompt_len]
            choices.append(choice)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model_name, "choices": choices,
                "usage": self._usage(drivers),
                "speculative": speculative_body(merged_stats(drivers), drivers[0].num_drafts)}

    def _usage(self, drivers: Sequence[SequenceDriver]) -> dict:
        """Each prompt counted once, as OpenAI does for ``n`` choices (its cached tokens
        are its first choice's)."""
        firsts = drivers[:: self.per_prompt]
        return usage_body(sum(d.state.prompt_len for d in firsts), sum(len(d.state.generated) for d in drivers),
                          sum(d.cached_tokens for d in firsts))

    # -- stream --------------------------------------------------------------------------
    def _chunk(self, choices: list, **extra) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        if self.include_usage:  # OpenAI's: null on every chunk but the usage one; vLLM's continuous: so far
            extra.setdefault("usage", usage_body(self._prompt_tokens, self._streamed, self._cached)
                             if self.continuous_usage else None)
        return "data: " + json.dumps({"id": self.id, "object": kind, "created": self.created,
                                      "model": self.model_name, "choices": choices, **extra}) + "\n\n"

    def opening(self, drivers: Sequence[SequenceDriver]) -> str:
        """What a stream starts with: chat announces the assistant role, per choice;
        completions nothing."""
        self._prompt_tokens = sum(d.state.prompt_len for d in drivers[:: self.per_prompt])
        self._cached = sum(d.cached_tokens for d in drivers[:: self.per_prompt])
        if not self.chat:
            return ""
        return "".join(self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]) for index in range(len(drivers)))

    def tokens(self, events: Sequence[ChoiceEvent], drivers: Sequence[SequenceDriver]) -> str:
        """One chunk per choice per write: a round's tokens (or the rounds a write holds)
        go out as one SSE event, their text joined and their ids and logprobs as lists, as
        an OpenAI chunk may carry several tokens -- one event per round, not per token,
        for the HTTP proxy and the client to parse. Events of different choices
        interleave in the order they came. A choice's last chunk (the one with
        ``finish_reason``) also carries that choice's speculative statistics: it has
        finished, so they are final."""
        parts, run = [], []
        for item in events:
            if run and (item.index != run[0].index or self.event_per_token):
                parts.append(self._choice_chunk(run[0].index, [e.event for e in run], drivers[run[0].index]))
                run = []
            run.append(item)
        if run:
            parts.append(self._choice_chunk(run[0].index, [e.event for e in run], drivers[run[0].index]))
        return "".join(parts)

    def _choice_chunk(self, index: int, events: list[TokenEvent], driver: SequenceDriver) -> str:
        """One choice's consecutive committed tokens as one chunk (only the last can finish it)."""
        parts = []
        first = index not in self._started
        self._started.add(index)
        self._streamed += len(events)
        if self.echoes and first:  # the choice's first write: its prompt first
            parts.append(self._echo(index, driver))
        finish_reason = events[-1].finish_reason
        extra = {"speculative": speculative_body(driver.stats, driver.num_drafts)} if finish_reason else {}
        logprobs = None
        items = [event.logprob for event in events if event.logprob is not None]
        if items:
            offset = self._offsets.get(index, 0)
            logprobs = (chat_logprobs(items, self.token_bytes) if self.chat else completion_logprobs(items, offset))
            # text_offset counts token texts, as the whole response's does: a stream's
            # text may lag its tokens (a possible stop string held back)
            self._offsets[index] = offset + sum(len(item.token) for item in items)
        ids = {"token_ids": [event.token_id for event in events]} if self.token_ids else {}
        if self.token_ids and first:  # as vLLM's: a choice's first chunk carries its prompt's ids
            ids["prompt_token_ids"] = driver.state.tokens[: driver.state.prompt_len]
        text = "".join(event.text for event in events)
        if self.chat:
            delta = {"content": text} if text else {}
            if self.tools is not None:  # the text is read as tool_calls, or as an auto reply's JSON string
                scanner = self._scanners.setdefault(index, self.tools.scanner())
                scanner.feed(text)
                calls, content = scanner.deltas(), scanner.content_delta()
                delta = {**({"content": content} if content else {}), **({"tool_calls": calls} if calls else {})}
                if finish_reason is not None:
                    finish_reason = _tool_finish(driver.state, scanner.tool_calls())
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason, **ids}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason, **ids}
        parts.append(self._chunk([choice], **extra))
        return "".join(parts)

    def _echo(self, index: int, driver: SequenceDriver) -> str:
        """A streamed choice's echoed prompt, as a chunk of its own before its first token's."""
        echo, state = self.echoes[index // self.per_prompt], driver.state
        logprobs = None
        self._offsets[index] = 0
        if state.options.logprobs:
            logprobs = completion_logprobs(state.prompt_logprobs or [], first=echo.first_token)
            self._offsets[index] = sum(len(token) for token in logprobs["tokens"])
        return self._chunk([{"index": index, "text": echo.text, "logprobs": logprobs, "finish_reason": None}])

    def closing(self, drivers: Sequence[SequenceDriver]) -> str:
        """After the last token: the usage chunk (empty ``choices``) if the client asked for
        it with ``stream_options.include_usage``, as OpenAI sends it; else nothing (a client
        reading ``chunk.choices[0]`` must never meet an empty chunk it did not ask for)."""
        if not self.include_usage:
            return ""
        return self._chunk([], usage=self._usage(drivers))

    @staticmethod
    def error(error: ApiError) -> str:
        """A failure after the stream started: an OpenAI error object as the last event."""
        return "data: " + json.dumps(error.body()) + "\n\n"
