"""What a request's output must match: a JSON schema, any JSON object, a regular
expression, one of a list of strings, or a Lark / GBNF grammar.

A ``StructuredOutput`` is a plain, hashable value (it rides in ``GenerationOptions`` to
the target worker, by value across processes); ``to_llguidance`` turns it into the
grammar text llguidance compiles. Nothing here compiles anything: ``compiler.py`` does,
once per grammar.
"""
from __future__ import annotations

import json
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

# How JSON is written: one space after ':' and ',' and no other whitespace. llguidance's
# default lets a model put any whitespace between tokens, and a small model under a
# grammar loops on newlines until max_tokens; fixed separators also make more of the
# output forced, which speculation accepts. A schema's own "x-guidance" settings win.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = '{"type": "object"}'


class StructuredOutput(BaseModel):
    """``kind`` and its ``value``: the schema as JSON text (``json_schema``), nothing
    (``json_object``), the pattern (``regex``, matched against the whole output), the
    choices as a JSON list of strings (``choice``), or Lark or GBNF text (``grammar``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: GrammarKind
    value: str = ""

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> "StructuredOutput":
        return cls(kind="json_schema", value=schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> "StructuredOutput":
        return cls(kind="json_object")

    @classmethod
    def regex(cls, pattern: str) -> "StructuredOutput":
        return cls(kind="regex", value=pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> "StructuredOutput":
        return cls(kind="choice", value=json.dumps(list(choices)))

    @classmethod
    def grammar(cls, text: str) -> "StructuredOutput":
        return cls(kind="grammar", value=text)

    @field_validator("value")
    @classmethod
    def _bounded(cls, value: str) -> str:
        if len(value) > 256 * 1024:
            raise ValueError("a schema, pattern or grammar is limited to 256 KiB")
        return value

    @model_validator(mode="after")
    def _value_fits_kind(self) -> "StructuredOutput":
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be a JSON object")
        elif self.kind == "choice":
            choices = json.loads(self.value) if self.value else None
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("choice takes a non-empty list of non-empty strings")
        elif self.kind in ("regex", "grammar") and not self.value:
            raise ValueError(f"{self.kind} must not be empty")
        return self

    def to_llguidance(self) -> str:
        """The grammar llguidance compiles. Raises ``ValueError`` naming what it cannot convert."""
        import llguidance

        matcher = llguidance.LLMatcher
        if self.kind == "json_schema":
            return matcher.grammar_from_json_schema(self.value, defaults=JSON_STYLE)
        if self.kind == "json_object":
            return matcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=JSON_STYLE)
        if self.kind == "regex":
            return matcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            return llguidance.grammar_from("choice", self.value)
        return llguidance.grammar_from("grammar", self.value)  # Lark, or GBNF converted to Lark
