"""``specserve chat``: an interactive terminal chat, against the embedded engine or a
running server's URL, printing each reply as it streams and then its speed and tau.

Lines starting with ``/`` are commands: ``/reset`` forgets the conversation, ``/exit``
(or end of input) leaves. The conversation is kept and sent whole every turn, as an
OpenAI client does.
"""
from __future__ import annotations

import json
import sys
import time
import urllib.request
from dataclasses import dataclass
from typing import Callable, Iterator, TextIO

PROMPT = "> "


@dataclass
class Reply:
    text: str
    tokens: int
    seconds: float           # first token to last
    tau: float | None        # tokens per target pass; None for target-only
    finish_reason: str | None

    def summary(self) -> str:
        rate = (self.tokens - 1) / self.seconds if self.seconds > 0 and self.tokens > 1 else 0.0
        tau = f", tau {self.tau:.2f}" if self.tau is not None else ""
        return f"[{self.tokens} tokens, {rate:.1f} tokens/s{tau}, finish_reason={self.finish_reason}]"


Answer = Callable[[list[dict], Callable[[str], None]], Reply]


def embedded(engine, options) -> Answer:
    """Replies from an in-process ``Engine``."""
    def answer(messages: list[dict], write: Callable[[str], None]) -> Reply:
        first: list[float] = []

        def on_token(event) -> None:
            if not first:
                first.append(time.perf_counter())
            write(event.text)

        result = engine.chat(messages, options, on_token=on_token)
        stats = result.speculative
        seconds = time.perf_counter() - first[0] if first else 0.0
        return Reply(result.text, result.completion_tokens, seconds,
                     stats.mean_accepted_length if stats.mode != "none" else None, result.finish_reason)
    return answer


def api_base(url: str) -> str:
    """A server's OpenAI base URL (``.../v1``), given it or the server's root."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def first_model(url: str) -> str:
    """The first model a server lists (``/v1/models``)."""
    with urllib.request.urlopen(api_base(url) + "/models", timeout=30) as response:
        return json.load(response)["data"][0]["id"]


def remote(url: str, body: dict, timeout: float = 600.0) -> Answer:
    """Replies from a server's ``/v1/chat/completions``, streamed (``body``: the request's
    other fields: model, max_tokens, temperature, speculative_mode ...)."""
    endpoint = api_base(url) + "/chat/completions"

    def answer(messages: list[dict], write: Callable[[str], None]) -> Reply:
        request = urllib.request.Request(endpoint, data=json.dumps({**body, "messages": messages, "stream": True,
                                                                   "return_token_ids": True}).encode(),
                                         headers={"Content-Type": "application/json"})
        text, tokens, first, finish, tau = "", 0, None, None, None
        with urllib.request.urlopen(request, timeout=timeout) as response:
            for chunk in _events(response):
                choice = chunk["choices"][0] if chunk.get("choices") else None
                if choice is None:
                    continue
                ids = choice.get("token_ids") or []
                if ids and first is None:
                    first = time.perf_counter()
                tokens += len(ids)
                piece = (choice.get("delta") or {}).get("content") or ""
                text += piece
                write(piece)
                finish = choice.get("finish_reason") or finish
                speculative = chunk.get("speculative")
                if speculative and speculative.get("mode") != "none":
                    tau = speculative.get("mean_accepted_length")
        return Reply(text, tokens, time.perf_counter() - first if first else 0.0, tau, finish)
    return answer


def _events(response) -> Iterator[dict]:
    for raw in response:
        line = raw.decode("utf-8").strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])


def run(answer: Answer, system: str | None = None, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    """The loop: read a line, answer it, print the reply and its figures."""
    opening = [{"role": "system", "content": system}] if system else []
    messages = list(opening)

    def write(text: str) -> None:
        stdout.write(text)
        stdout.flush()

    write("specserve chat: type a message; /reset forgets the conversation, /exit leaves.\n")
    while True:
        write(PROMPT)
        line = stdin.readline()
        if not line:
            write("\n")
            return 0
        line = line.strip()
        if not line:
            continue
        if line == "/exit":
            return 0
        if line == "/reset":
            messages = list(opening)
            write("(conversation reset)\n")
            continue
        messages.append({"role": "user", "content": line})
        reply = answer(messages, write)
        messages.append({"role": "assistant", "content": reply.text})
        write(f"\n{reply.summary()}\n")
