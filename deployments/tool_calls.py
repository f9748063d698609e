"""Chat tool calls: OpenAI's ``tools`` and ``tool_choice`` turned into a grammar and a
prompt, and the constrained output turned back into ``tool_calls``.

- ``tool_choice`` naming a function: the output is that function's arguments, a JSON
  object held to its ``parameters`` schema by the grammar.
- ``"required"``: the output is a JSON array of calls, each ``{"name": <one of the
  tools>, "parameters": <its arguments>}`` (vLLM's shape for it), at least one, exactly
  one without ``parallel_tool_calls``.
- ``"none"``: no tools; the model answers in text, and is not shown them.
- ``"auto"`` (OpenAI's default when tools are given) lets the model choose between text
  and a call, which takes a chat template that renders tools and a parser for the
  model's own call syntax; a model that has both names its parser in
  ``tokenizer_config.json`` (``tool_call_parser``). specserve has no such parser yet, so
  ``"auto"`` is refused, saying what to use instead.

A forced call's grammar fixes the output's shape, but the model still has to choose the
arguments, so it is shown the tools: a system message (before the conversation's own
system prompt, if any) lists each function's name, description and parameters and says
what to write, as vLLM does for chat templates that do not render tools. An assistant
message carrying earlier ``tool_calls`` is rendered as the JSON the model would have
written for them.

``ToolCallScanner`` reads the output as it grows, so a stream's deltas and a whole
response's ``tool_calls`` come from the same reading of the same text.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

from engine.grammar.spec import StructuredOutput

from .openai_protocol import ApiError, ChatCompletionRequest, ChatMessage, NamedToolChoice

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's forced call(s): which functions, and whether one is named."""

    functions: tuple[dict[str, Any], ...]  # {"name", "description", "parameters"} each
    named: str | None                      # the function tool_choice names; None: "required"
    parallel: bool = True

    def parameters(self, name: str) -> dict[str, Any]:
        return next(f["parameters"] for f in self.functions if f["name"] == name)

    def output_schema(self) -> dict[str, Any]:
        """The JSON schema the output is held to."""
        if self.named is not None:
            return self.parameters(self.named)
        call = {"anyOf": [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                           "parameters": f["parameters"]},
                           "required": ["name", "parameters"], "additionalProperties": False}
                          for f in self.functions]}
        return {"type": "array", "items": call, "minItems": 1, **({} if self.parallel else {"maxItems": 1})}

    def structured_output(self) -> StructuredOutput:
        return StructuredOutput.json_schema(self.output_schema())

    def instructions(self) -> str:
        """The system message that shows the model its tools and what to write."""
        listed = "\n".join(json.dumps({k: v for k, v in f.items() if v is not None}) for f in self.functions)
        if self.named is not None:
            ask = f"Call the function {self.named}: answer with its arguments as one JSON object, and nothing else."
        else:
            many = "one or more calls" if self.parallel else "exactly one call"
            ask = (f"Call {'them' if len(self.functions) > 1 else 'it'}: answer with a JSON array of {many}, "
                   'each {"name": <function name>, "parameters": <its arguments>}, and nothing else.')
        return f"You can call these functions:\n{listed}\n{ask}"

    def scanner(self) -> "ToolCallScanner":
        return ToolCallScanner(self.named)


def tool_plan(body: ChatCompletionRequest, template_renders_tools: bool) -> ToolPlan | None:
    """The request's forced call, None for no call (no tools, or ``"none"``); raises
    ``ApiError`` for ``"auto"`` and for a forced call beside another output format."""
    if not body.tools or body.tool_choice == "none":
        return None
    choice = body.tool_choice
    if choice in (None, "auto"):
        renders = "renders tools but names no tool_call_parser" if template_renders_tools \
            else "does not render tools"
        raise ApiError(400, f"tool_choice 'auto' needs a chat template that renders tools and a parser for the "
                       f"model's tool-call syntax; this model's template {renders}. Set tool_choice to 'required', "
                       f"to a named function, or to 'none'", param="tool_choice")
    if body.structured_outputs is not None or (body.response_format is not None
                                               and body.response_format.type != "text"):
        raise ApiError(400, "a forced tool call fixes the output's format: drop response_format / "
                       "structured_outputs", param="tool_choice")
    functions = tuple({"name": t.function.name, "description": t.function.description,
                       "parameters": t.function.parameters or NO_ARGUMENTS} for t in body.tools)
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    return ToolPlan(functions, named, body.parallel_tool_calls)


def render_messages(messages: Sequence[ChatMessage], plan: ToolPlan | None) -> list[dict]:
    """The messages the chat template renders: earlier calls as the JSON written for
    them, and, for a forced call, the tools' system message first."""
    rendered = []
    for message in messages:
        item = message.model_dump(exclude_none=True, exclude={"tool_calls", "tool_call_id"})
        if message.tool_calls and not item.get("content"):
            item["content"] = json.dumps([{"name": c.function.name, "parameters": _arguments(c.function.arguments)}
                                          for c in message.tool_calls])
        rendered.append(item)
    if plan is not None:
        rendered.insert(0, {"role": "system", "content": plan.instructions()})
    return rendered


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # shown as the string it was


@dataclass
class _Call:
    id: str
    name: str | None = None
    start: int | None = None     # where its arguments begin in the text
    end: int | None = None       # where they end, once they have
    sent: int = 0                # characters of its arguments already in a delta
    announced: bool = False      # its id and name have been in a delta


@dataclass
class ToolCallScanner:
    """Reads a forced call's output as it grows (``feed``) and says which calls it holds
    and what of their arguments is new (``deltas``), in OpenAI's streaming shape.

    ``named``: the output is that function's arguments, whole. Otherwise it is the
    ``"required"`` array, read with a small JSON state machine: each element's ``name``
    string once it closes, and the raw text of its ``parameters`` value -- the model's own
    characters, so the arguments streamed add up to the arguments returned whole."""

    named: str | None
    text: str = ""
    calls: list[_Call] = field(default_factory=list)
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _string_start: int = 0
    _key: str | None = None      # the element's key being read or whose value follows
    _expect_key: bool = False
    _value_of: str | None = None  # the key whose value is being read

    def feed(self, delta: str) -> None:
        start = len(self.text)
        self.text += delta
        if self.named is not None:
            if not self.calls and self.text:
                self.calls.append(_Call(call_id(), self.named, 0))
            return
        for i in range(start, len(self.text)):
            self._step(i, self.text[i])

    def _step(self, i: int, char: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
                self._string_closed(i)
            return
        if char == '"':
            self._in_string, self._string_start = True, i
            if self._depth == 2 and self._value_of == "parameters" and self.calls[-1].start is None:
                self.calls[-1].start = i
            return
        if char in "[{":
            if self._depth == 1 and char == "{":
                self.calls.append(_Call(call_id()))
                self._expect_key, self._value_of = True, None
            elif self._depth == 2 and self._value_of == "parameters" and self.calls[-1].start is None:
                self.calls[-1].start = i
            self._depth += 1
        elif char in "]}":
            self._depth -= 1
            if self._depth == 1 and char == "}" and self.calls:
                self._close_parameters(i)
        elif self._depth == 2:
            if char == ":":
                self._value_of, self._expect_key = self._key, False
            elif char == ",":
                self._close_parameters(i)
                self._expect_key, self._value_of = True, None
            elif not char.isspace() and self._value_of == "parameters" and self.calls[-1].start is None:
                self.calls[-1].start = i  # a number, true, false or null

    def _string_closed(self, i: int) -> None:
        if self._depth != 2:
            return
        raw = self.text[self._string_start: i + 1]
        if self._expect_key:
            self._key = json.loads(raw)
        elif self._value_of == "name" and self.calls[-1].name is None:
            self.calls[-1].name = json.loads(raw)

    def _close_parameters(self, i: int) -> None:
        call = self.calls[-1]
        if self._value_of == "parameters" and call.start is not None and call.end is None:
            call.end = len(self.text[:i].rstrip())

    def arguments(self, call: _Call) -> str:
        if call.start is None:
            return ""
        return self.text[call.start: len(self.text) if call.end is None else call.end]

    def deltas(self) -> list[dict]:
        """OpenAI's ``delta.tool_calls`` entries for what the text added since the last
        call: a call's first carries its id, type and name (arguments so far), later ones
        only more arguments. A call is announced once its name is known."""
        out = []
        for index, call in enumerate(self.calls):
            if call.name is None:
                continue
            arguments = self.arguments(call)
            new = arguments[call.sent:]
            if not call.announced:
                call.announced = True
                out.append({"index": index, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": new}})
            elif new:
                out.append({"index": index, "function": {"arguments": new}})
            call.sent = len(arguments)
        return out

    def tool_calls(self) -> list[dict]:
        """The calls in the text, whole: the message's ``tool_calls``."""
        return [{"id": call.id, "type": "function", "function": {"name": call.name, "arguments": self.arguments(call)}}
                for call in self.calls if call.name is not None]
