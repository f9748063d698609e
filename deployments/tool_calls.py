"""Chat tool calls: OpenAI's ``tools`` and ``tool_choice`` turned into a grammar and a
prompt, and the constrained output turned back into ``tool_calls``.

A model whose chat template renders tools and asks for ``<tool_call>`` blocks gets its own
format (``hermes_tool_calls``). Every other model gets one generic format, whatever its
chat template (llama.cpp's approach; vLLM instead needs a parser per model family):
- ``tool_choice`` naming a function: the output is that function's arguments, a JSON
  object held to its ``parameters`` schema by the grammar.
- ``"required"``: the output is a JSON array of calls, each ``{"name": <one of the
  tools>, "parameters": <its arguments>}`` (vLLM's shape for it), at least one, exactly
  one without ``parallel_tool_calls``.
- ``"auto"`` (OpenAI's default when tools are given): the output is one JSON object,
  either ``{"tool_calls": <that array>}`` or ``{"response": <the reply as a string>}``;
  the model chooses at its second token. A reply comes back as the message's
  ``content``, decoded from the string as it streams.
- ``"none"``: no tools; the model answers in text, and is not shown them.

The model is shown the tools: a system message (before the conversation's own system
prompt, if any) lists each function's name, description and parameters and says what to
write. An assistant message carrying earlier ``tool_calls`` is rendered as the JSON the
model would have written for them.

Arguments are held to each function's ``parameters`` schema, strictly by default: an
object schema that does not say otherwise gets ``additionalProperties: false``, so no
key the schema never named is written (llama.cpp's grammars do the same).
``"strict": false`` on a function takes its schema as written instead.

A call is returned only once its arguments are complete JSON: a whole response lists the
complete calls, and a stream sends each call whole, in one delta, when its arguments
close. Output cut by ``max_tokens`` (``finish_reason: "length"``) keeps the calls that
completed and drops the one it cut.

``ToolCallScanner`` reads the output as it grows, so a stream's deltas and a whole
response's ``tool_calls`` come from the same reading of the same text.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

from specserve.engine.grammar.spec import StructuredOutput
from specserve.engine.model.chat import ChatTemplate

from . import hermes_tool_calls as hermes
from .call_reading import CallReading
from .openai_protocol import ApiError, ChatCompletionRequest, ChatMessage, NamedToolChoice

ToolFormat = Literal["generic", "hermes"]  # how the model is shown tools and writes calls

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
# How "auto" output opens (the grammar writes JSON with fixed separators: JSON_STYLE in
# engine/grammar/spec.py), so the first characters say which it is.
CALLS_OPENING = '{"tool_calls": '
REPLY_OPENING = '{"response": "'
# The schema keywords whose values are schemas, or lists or maps of them, that
# ``closed`` walks into; allOf's members are left open, as closing each would forbid
# the keys the others add.
_SUBSCHEMA = ("items", "additionalItems", "not", "if", "then", "else", "contains")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that says
    nothing about extra keys: a strict tool's arguments carry only the keys it names."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    for key in _SUBSCHEMA:
        if key in out:
            out[key] = closed(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(member) for member in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(member) for name, member in out[key].items()}
    return out


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tool calls: which functions, and whether one is named
    (``named``), at least one is required, or the model chooses (``auto``)."""

    functions: tuple[dict[str, Any], ...]  # {"name", "description", "parameters", "strict"} each, as sent
    named: str | None                      # the function tool_choice names
    parallel: bool = True
    auto: bool = False                     # "auto": a call or a reply
    format: ToolFormat = "generic"

    def parameters(self, name: str) -> dict[str, Any]:
        """The schema a function's arguments are held to."""
        function = next(f for f in self.functions if f["name"] == name)
        return _held_schema(function["parameters"], function.get("strict"))

    def _calls_schema(self) -> dict[str, Any]:
        call = {"anyOf": [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                           "parameters": self.parameters(f["name"])},
                           "required": ["name", "parameters"], "additionalProperties": False}
                          for f in self.functions]}
        return {"type": "array", "items": call, "minItems": 1, **({} if self.parallel else {"maxItems": 1})}

    def output_schema(self) -> dict[str, Any]:
        """The JSON schema the output is held to."""
        if self.named is not None:
            return self.parameters(self.named)
        if not self.auto:
            return self._calls_schema()
        return {"anyOf": [
            {"type": "object", "properties": {"tool_calls": self._calls_schema()}, "required": ["tool_calls"],
             "additionalProperties": False},
            {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
             "additionalProperties": False}]}

    def structured_output(self) -> StructuredOutput:
        if self.format == "hermes":
            return hermes.grammar([(f["name"], self.parameters(f["name"])) for f in self.functions],
                                  self.named, self.parallel, self.auto)
        return StructuredOutput.json_schema(self.output_schema())

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template renders itself (the Hermes format); None: the
        generic format shows them in a system message of its own (``instructions``)."""
        return hermes.template_tools(self.functions) if self.format == "hermes" else None

    def instructions(self) -> str:
        """The system message that shows the model its tools and what to write."""
        # The schemas as sent: a 135M model calls less often when shown the closed ones
        listed = "\n".join(json.dumps({k: v for k, v in f.items() if v is not None and k != "strict"})
                           for f in self.functions)
        many = "one entry per call needed" if self.parallel else "exactly one call"
        if self.named is not None:
            ask = f"Call the function {self.named}: answer with its arguments as one JSON object, and nothing else."
        elif self.auto:
            # The wording a 135M model follows, measured in docs/design-decisions.md ("Tool calls").
            return (f"You are a helpful assistant with access to the following functions:\n{listed}\n"
                    'To call functions, respond with JSON {"tool_calls": [{"name": ..., "parameters": {...}}]}, '
                    f'{many}. To answer without a function, respond with JSON {{"response": "..."}}. '
                    "Call a function whenever one can answer the question.")
        else:
            ask = (f"Call {'them' if len(self.functions) > 1 else 'it'}: answer with a JSON array of "
                   f"{'one or more calls' if self.parallel else 'exactly one call'}, "
                   'each {"name": <function name>, "parameters": <its arguments>}, and nothing else.')
        return f"You can call these functions:\n{listed}\n{ask}"

    def written_calls(self, calls: list[dict[str, Any]]) -> str:
        """Earlier calls (``{"name", "parameters"}`` each) as the model writes them."""
        return json.dumps({"tool_calls": calls} if self.auto else calls)

    def scanner(self) -> "CallScanner":
        if self.format == "hermes":
            return hermes.HermesCallScanner(self.named, call_id, self.auto)
        return ToolCallScanner(self.named, self.auto)


def tool_format(template: ChatTemplate) -> ToolFormat:
    """The format a model is served tool calls in: ``hermes`` where its chat template
    renders the tools it is given and asks for ``<tool_call>`` blocks, else ``generic``."""
    native = template.source is not None and hermes.OPEN.strip() in template.source and template.renders_tools()
    return "hermes" if native else "generic"


def tool_plan(body: ChatCompletionRequest, format: ToolFormat = "generic") -> ToolPlan | None:
    """The request's tool calls in ``format`` (``tool_format``), None for none (no tools,
    or ``"none"``); raises ``ApiError`` for tools beside another output format."""
    if not body.tools or body.tool_choice == "none":
        return None
    choice = body.tool_choice
    if body.structured_outputs is not None or (body.response_format is not None
                                               and body.response_format.type != "text"):
        raise ApiError(400, "tool calls fix the output's format: drop response_format / structured_outputs, "
                       "or set tool_choice to 'none'", param="tool_choice")
    functions = tuple({"name": t.function.name, "description": t.function.description,
                       "parameters": t.function.parameters or NO_ARGUMENTS, "strict": t.function.strict}
                      for t in body.tools)
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    return ToolPlan(functions, named, body.parallel_tool_calls, auto=choice in (None, "auto"), format=format)


def _held_schema(parameters: dict[str, Any], strict: bool | None) -> dict[str, Any]:
    return parameters if strict is False else closed(parameters)


def render_messages(messages: Sequence[ChatMessage], plan: ToolPlan | None) -> list[dict]:
    """The messages the chat template renders: earlier calls as the JSON written for
    them, and, with tools, the tools' system message first; in the Hermes format, the
    calls as the template's own ``tool_calls`` and no system message of ours."""
    rendered = []
    native = plan is not None and plan.format == "hermes"
    for message in messages:
        item = message.model_dump(exclude_none=True, exclude={"tool_calls", "tool_call_id"})
        if message.tool_calls and native:
            item = hermes.template_message(item, [(c.function.name, _arguments(c.function.arguments))
                                                  for c in message.tool_calls])
        elif message.tool_calls and not item.get("content"):
            calls = [{"name": c.function.name, "parameters": _arguments(c.function.arguments)}
                     for c in message.tool_calls]
            item["content"] = plan.written_calls(calls) if plan is not None else json.dumps(calls)
        rendered.append(item)
    if plan is not None and not native:
        rendered.insert(0, {"role": "system", "content": plan.instructions()})
    return rendered


def render_prompt(template: ChatTemplate, messages: Sequence[ChatMessage], plan: ToolPlan | None) -> str:
    """The chat's prompt: ``render_messages`` through the template, with the tools where
    the template renders them."""
    return template.render(render_messages(messages, plan), tools=plan.template_tools() if plan else None)


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # shown as the string it was


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def decoded_prefix(raw: str) -> str:
    """The characters of a JSON string's body written so far (``raw`` follows the opening
    quote): up to its closing quote, less a trailing escape not yet complete or a high
    surrogate whose pair has not come, so a prefix of the text decodes to a prefix."""
    escaped, end = False, len(raw)
    for i, char in enumerate(raw):
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            end = i
            break
    body = raw[:end]
    for cut in range(len(body), max(len(body) - 6, 0) - 1, -1):
        try:
            text = json.loads(f'"{body[:cut]}"')
        except json.JSONDecodeError:
            continue
        return text[:-1] if text and "\ud800" <= text[-1] <= "\udbff" else text
    return ""


@dataclass
class _Call:
    id: str
    name: str | None = None
    start: int | None = None     # where its arguments begin in the text
    end: int | None = None       # where they end, once they have
    sent: bool = False           # it has been in a delta


@dataclass
class ToolCallScanner(CallReading):
    """Reads the output as it grows (``feed``) and says which complete calls it holds
    (``tool_calls``), which are new (``deltas``, OpenAI's streaming shape) and, for an
    ``auto`` reply, its text (``content``, ``content_delta``).

    ``named``: the output is that function's arguments, whole. Otherwise it holds the
    array of calls (after ``CALLS_OPENING`` under ``auto``), read with a small JSON state
    machine: each element's ``name`` string once it closes, and the raw text of its
    ``parameters`` value -- the model's own characters, so the arguments streamed are the
    arguments returned whole."""

    named: str | None
    auto: bool = False
    text: str = ""
    calls: list[_Call] = field(default_factory=list)
    reply: bool | None = None     # auto: a reply (True) or calls (False); None: not yet known
    _content_sent: int = 0
    _named_complete: bool = False
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
            if self.text.rstrip().endswith("}") and _parses(self.text):
                self._named_complete = True
            return
        if self.auto:
            if self.reply is None:
                if self.text.startswith(CALLS_OPENING):
                    self.reply = False
                elif self.text.startswith(REPLY_OPENING):
                    self.reply = True
            if self.reply is not False:
                return
            start = max(start, len(CALLS_OPENING))
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

    def _complete(self, call: _Call) -> bool:
        if call.name is None:
            return False
        if self.named is not None:
            return self._named_complete
        return call.end is not None and _parses(self.arguments(call))

    def complete_calls(self) -> list[_Call]:
        """The calls whose arguments are complete JSON, in order (they complete in order)."""
        return [call for call in self.calls if self._complete(call)]

    def content(self) -> str | None:
        """An ``auto`` reply's text so far; None for calls."""
        return decoded_prefix(self.text[len(REPLY_OPENING):]) if self.reply else None


CallScanner = ToolCallScanner | hermes.HermesCallScanner  # one reading of the output per format
