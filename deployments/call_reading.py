"""What a tool-call scanner gives the response, whatever format it reads: each complete
call whole, as a message's ``tool_calls`` or once in a stream's delta, and an ``auto``
reply's text. A scanner (``tool_calls.ToolCallScanner``, ``hermes_tool_calls.
HermesCallScanner``) says which calls are complete and what a reply's text is so far."""
from __future__ import annotations

from typing import Any


class CallReading:
    """The response's side of a scanner, which provides ``reply`` (an ``auto`` reply:
    True), ``_content_sent``, ``complete_calls`` (each call with ``id``, ``name`` and
    ``sent``, whether it has been in a delta), ``arguments`` and ``content``."""

    reply: bool | None
    _content_sent: int

    def complete_calls(self) -> list[Any]:
        raise NotImplementedError

    def arguments(self, call: Any) -> str:
        raise NotImplementedError

    def content(self) -> str | None:
        raise NotImplementedError

    def deltas(self) -> list[dict]:
        """OpenAI's ``delta.tool_calls`` entries for the calls completed since the last
        call: each whole, with its id, type, name and arguments."""
        out = []
        for index, call in enumerate(self.complete_calls()):
            if not call.sent:
                call.sent = True
                out.append({"index": index, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": self.arguments(call)}})
        return out

    def tool_calls(self) -> list[dict]:
        """The complete calls: the message's ``tool_calls``."""
        return [{"id": call.id, "type": "function", "function": {"name": call.name, "arguments": self.arguments(call)}}
                for call in self.complete_calls()]

    def content_delta(self) -> str:
        """The reply's text added since the last call."""
        text = self.content() or ""
        new, self._content_sent = text[self._content_sent:], len(text)
        return new

    def message(self) -> dict[str, Any]:
        """The whole response's assistant message."""
        if self.reply:
            return {"role": "assistant", "content": self.content()}
        return {"role": "assistant", "content": None, "tool_calls": self.tool_calls() or None}
