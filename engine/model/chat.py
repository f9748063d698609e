"""Chat messages to a prompt string.

A model directory whose ``tokenizer_config.json`` carries a ``chat_template`` (the
Hugging Face convention) is rendered with it (Jinja2, imported only then). Otherwise
the documented default applies -- each message as ``<role>: <content>`` on its own
line, then ``assistant:`` for the model to continue. The default deliberately does not
end in a newline: byte-level BPE merges a newline with the indentation that follows,
so a prompt ending in a bare newline is off-distribution for the model.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from specserve.engine.errors import InvalidRequestError, ModelLoadError

DEFAULT_TEMPLATE_DESCRIPTION = "'<role>: <content>' per message, one per line, then 'assistant:'"


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """transformers' ``tojson`` for chat templates: plain text, keys in their order, not
    Jinja's HTML-safe markup (which escapes the text it is joined to)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    def __init__(self, template: str | None = None, bos_token: str = "", eos_token: str = "") -> None:
        self.source, self.bos_token, self.eos_token = template, bos_token, eos_token
        self._compiled = None
        if template is not None:
            try:
                import jinja2
                import jinja2.sandbox
            except ImportError as exc:  # pragma: no cover - jinja2 ships with the serve extra
                raise ModelLoadError("this model's chat_template needs the 'jinja2' package") from exc
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = _tojson
            self._compiled = env.from_string(template)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ChatTemplate":
        path = Path(model_dir) / "tokenizer_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        token = lambda v: v.get("content", "") if isinstance(v, dict) else (v or "")  # noqa: E731
        return cls(template, token(config.get("bos_token")), token(config.get("eos_token")))

    def render(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
        """The prompt; ``tools`` (Hugging Face's shape) go to a template that renders them."""
        if not messages:
            raise InvalidRequestError("messages must contain at least one message")
        if self._compiled is not None:
            extra = {"tools": list(tools)} if tools else {}
            return self._compiled.render(messages=list(messages), add_generation_prompt=True,
                                         bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return "\n".join([*lines, "assistant:"])

    def renders_tools(self) -> bool:
        """Whether the template shows the model the tools it is given."""
        probe = {"type": "function", "function": {"name": "specserve_probe_tool", "description": "a probe",
                                                  "parameters": {"type": "object", "properties": {}}}}
        try:
            return "specserve_probe_tool" in self.render([{"role": "user", "content": "hi"}], tools=[probe])
        except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
            return False
