"""Tool calls in the Hermes format, for models whose chat template renders tools itself and
asks for ``<tool_call>`` blocks (Qwen2.5 and Qwen3, the Hermes models, SmolLM3; vLLM's
``--tool-call-parser hermes``). The template shows the model its tools; the model writes
each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and the calls one after another, a newline between them. The output is held to that by a
Lark grammar whose calls are JSON under each function's schema (``%json``, llguidance),
so every call the grammar lets through is a call to a tool the request named, with
arguments its schema allows. Under ``auto`` the output is either such calls or a plain
reply, which cannot open with ``<`` (the grammar's way of telling the two apart at the
first character).

``HermesCallScanner`` reads the output as it grows with the interface of
``tool_calls.ToolCallScanner``: a call is returned once its block closes, so a call cut
by ``max_tokens`` never comes back; a reply streams as its text.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from specserve.engine.grammar.spec import JSON_STYLE, StructuredOutput

from .call_reading import CallReading

OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"


def grammar(functions: Sequence[tuple[str, dict[str, Any]]], named: str | None, parallel: bool,
            auto: bool) -> StructuredOutput:
    """The Lark grammar of the output: ``functions`` as (name, the schema its arguments
    are held to); one call to ``named``, or one or more calls (one without ``parallel``),
    or, under ``auto``, those calls or a reply."""
    chosen = [(name, schema) for name, schema in functions if named is None or name == named]
    call = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                       "required": ["name", "arguments"], "additionalProperties": False}
                      for name, schema in chosen], "x-guidance": JSON_STYLE}
    calls = "call" if named is not None or not parallel else 'call ("\\n" call)*'
    rules = [f"start: {'calls | reply' if auto else 'calls'}",
             f"calls: {calls}",
             f"call: {json.dumps(OPEN)} tool {json.dumps(CLOSE)}",
             f"tool: %json {json.dumps(call)}"]
    if auto:
        rules.append(r"reply: /[^<](.|\n)*/")
    return StructuredOutput.grammar("\n".join(rules) + "\n")


def template_tools(functions: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's functions as a chat template reads them (Hugging Face's ``tools``)."""
    return [{"type": "function", "function": {k: v for k, v in f.items() if k != "strict" and v is not None}}
            for f in functions]


def template_message(item: dict[str, Any], calls: list[tuple[str, Any]]) -> dict[str, Any]:
    """An assistant message with earlier calls as a chat template reads them: each call's
    ``arguments`` an object, as Hugging Face's templates write them back."""
    return {**item, "content": item.get("content") or "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}
                           for name, arguments in calls]}


@dataclass
class _Call:
    id: str
    name: str
    arguments: str
    sent: bool = False


@dataclass
class HermesCallScanner(CallReading):
    """``tool_calls.ToolCallScanner``'s reading of the output, for the Hermes format."""

    named: str | None
    new_id: Callable[[], str]
    auto: bool = False
    text: str = ""
    calls: list[_Call] = field(default_factory=list)
    reply: bool | None = None     # auto: a reply (True) or calls (False); None: not yet known
    _read: int = 0                # where the next unread block starts
    _content_sent: int = 0

    def feed(self, delta: str) -> None:
        self.text += delta
        if self.reply is None and self.text:
            self.reply = self.auto and not self.text.startswith("<")
        if self.reply:
            return
        while (start := self.text.find(OPEN, self._read)) >= 0 and (end := self.text.find(CLOSE, start)) >= 0:
            self._read = end + len(CLOSE)
            try:
                call = json.loads(self.text[start + len(OPEN): end])
            except json.JSONDecodeError:
                continue  # the grammar writes none such; a model without it might
            if isinstance(call, dict) and isinstance(call.get("name"), str) and "arguments" in call:
                self.calls.append(_Call(self.new_id(), call["name"], json.dumps(call["arguments"], ensure_ascii=False)))

    def complete_calls(self) -> list[_Call]:
        return list(self.calls)

    def arguments(self, call: _Call) -> str:
        return call.arguments

    def content(self) -> str | None:
        return self.text if self.reply else None
