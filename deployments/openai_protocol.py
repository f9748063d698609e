"""OpenAI-compatible request shapes and errors (the subset specserve serves).

Requests are strict: a field this server does not know is a 400 naming the field,
rather than a silently ignored setting. Fields OpenAI defines but specserve does not
implement are accepted only at their neutral value (``suffix`` null, ``best_of`` = ``n``,
a completion's ``tools`` null, ...), so a client that sends defaults works and one that
relies on them is told. Structured output: OpenAI's ``response_format`` (``json_object``,
``json_schema``) and vLLM's ``structured_outputs``; chat's ``tools`` with ``tool_choice``
(``tool_calls.py`` turns them into a grammar and a prompt).
``null`` for an optional field is its default (``_OpenAIModel``).
Extensions (vLLM-style extra body fields): ``speculative_mode``,
``num_speculative_tokens`` (the most drafts per round), ``adaptive_speculation``,
``top_k``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``min_tokens``,
``return_token_ids`` (each choice, and each streamed chunk, carries ``token_ids``);
every response carries the request's speculative statistics under ``speculative``.
The response bodies and SSE chunks are built in ``openai_responses.py``.
"""
from __future__ import annotations

import re
import types
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictInt, ValidationInfo, field_validator, model_validator

from specserve.engine.grammar.spec import StructuredOutput
from specserve.engine.options import (MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, GenerationOptions, LogitBiasValue, OptionFields,
                            TokenId, checked_stops)

MAX_CHOICES = 16  # n: each choice reserves its own KV
_TOKEN_ID = re.compile(r"[0-9]{1,10}")  # a logit_bias key (a token id, as a string)


class ApiError(Exception):
    """An error the client should see, with its HTTP status and OpenAI error type."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _nullable(annotation) -> bool:
    return annotation is type(None) or (get_origin(annotation) in (Union, types.UnionType)
                                        and type(None) in get_args(annotation))


class _OpenAIModel(BaseModel):
    """Strict about unknown fields, lenient about ``null``: OpenAI types its optional
    fields "X or null" and clients send unset settings as ``null``, so a ``null`` for a
    field that has no null meaning of its own is the field's default. Unknown fields
    listed in ``_NEUTRAL_NULLS`` (OpenAI's, which specserve does not implement) are
    accepted at ``null`` and dropped."""

    model_config = ConfigDict(extra="forbid")
    _NEUTRAL_NULLS: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data):
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {key: value for key, value in data.items()
                if value is not None or (key in fields and _nullable(fields[key].annotation))
                or (key not in fields and key not in cls._NEUTRAL_NULLS)}


class StreamOptions(_OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class JsonSchemaFormat(_OpenAIModel):
    """OpenAI's ``response_format.json_schema``. ``strict`` is accepted either way: the
    schema is enforced as given, by the grammar, strict or not."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only with it")
        return self

    def structured_output(self) -> StructuredOutput | None:
        if self.type == "json_object":
            return StructuredOutput.json_object()
        if self.type == "json_schema":
            return StructuredOutput.json_schema(self.json_schema.schema_)
        return None


class StructuredOutputs(_OpenAIModel):
    """vLLM's ``structured_outputs`` extension: exactly one of ``json`` (a JSON schema, as
    an object or its text), ``regex``, ``choice``, ``grammar`` (Lark or GBNF) and
    ``json_object``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, "json_" if name == "json" else name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar and json_object"
                             + (f" (got {', '.join(given)})" if given else ""))
        return self

    def structured_output(self) -> StructuredOutput:
        if self.json_ is not None:
            return StructuredOutput.json_schema(self.json_)
        if self.regex is not None:
            return StructuredOutput.regex(self.regex)
        if self.choice is not None:
            return StructuredOutput.choice(self.choice)
        if self.grammar is not None:
            return StructuredOutput.grammar(self.grammar)
        return StructuredOutput.json_object()


class _SamplingFields(_OpenAIModel, OptionFields):
    """The sampling and speculation fields of a completion or chat request: the engine's
    ``OptionFields`` (top_p, the penalties, min_tokens, ignore_eos and the speculative
    extensions) as they are, and the fields whose wire form or limits are OpenAI's."""

    _NEUTRAL_NULLS: ClassVar[frozenset[str]] = frozenset({
        "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call", "metadata", "store",
        "service_tier", "prediction"})  # chat declares tools, tool_choice and parallel_tool_calls

    model: str | None = Field(None, examples=["SmolLM2-135M-Instruct"])  # optional, as vLLM's; checked when given
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # each choice is a sequence of its own (seeded: seed + its index)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    logit_bias: dict[str, Annotated[LogitBiasValue, Strict()]] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    user: str | None = None
    response_format: ResponseFormat | None = None  # text, json_object or json_schema
    structured_outputs: StructuredOutputs | None = None  # vLLM's: json, regex, choice, grammar, json_object
    # extensions
    top_k: int = Field(0, ge=-1)  # 0 or -1 (vLLM's spelling): no top-k cut
    stop_token_ids: list[Annotated[TokenId, Strict()]] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)  # vLLM's
    return_token_ids: bool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = (value,) if isinstance(value, str) else tuple(value or ())
        if len(stops) > 4:
            raise ValueError("stop takes up to 4 strings")
        return checked_stops(stops)

    @field_validator("top_k")
    @classmethod
    def _top_k_off(cls, value):
        return max(value, 0)

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options can only be set when stream is true")
        return value

    @model_validator(mode="after")
    def _one_output_constraint(self):
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise ValueError("give response_format or structured_outputs, not both")
        return self

    def structured_output(self) -> StructuredOutput | None:
        """What the output must match, from whichever field says so."""
        if self.structured_outputs is not None:
            return self.structured_outputs.structured_output()
        return self.response_format.structured_output() if self.response_format is not None else None

    @property
    def grammar_param(self) -> str:
        """The field a bad grammar is reported against."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    @field_validator("logit_bias")
    @classmethod
    def _bias_ids(cls, value):
        """OpenAI's keys are token ids as strings ("50256"); anything else is an error, and
        so are two keys for one id ("5" and "05"), which would leave one bias unsaid."""
        if value:
            if not all(_TOKEN_ID.fullmatch(key) for key in value):
                raise ValueError("logit_bias keys must be token ids written in ASCII digits, e.g. {\"50256\": -100}")
            if len({int(key) for key in value}) != len(value):
                raise ValueError("logit_bias names a token id twice")
        return value

    def options(self, max_tokens: int, logprobs: bool, top_logprobs: int,
                structured_output: StructuredOutput | None = None) -> GenerationOptions:
        """The engine's options for this request: the shared ``OptionFields`` as they are,
        the others from their wire form, and the token budget, logprobs and (for a tool
        call) the output's grammar the router worked out."""
        shared = {name: getattr(self, name) for name in OptionFields.model_fields}
        return GenerationOptions(**shared, max_new_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
                                 seed=self.seed, stop=self.stop,
                                 logit_bias={int(key): bias for key, bias in (self.logit_bias or {}).items()},
                                 stop_token_ids=tuple(self.stop_token_ids or ()), logprobs=logprobs,
                                 top_logprobs=top_logprobs,
                                 structured_output=structured_output or self.structured_output())


class CompletionRequest(_SamplingFields):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]] = Field(examples=["def read_config(path):"])
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False  # the prompt before each choice's text (and, with logprobs, its tokens' logprobs first)
    best_of: int | None = None  # only n itself: a best_of > n would rank candidates, which specserve does not
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _prompts_not_empty(cls, value):
        batch = value if isinstance(value, list) and value and isinstance(value[0], (str, list)) else [value]
        if any(len(prompt) == 0 for prompt in batch):
            raise ValueError("prompt must not be empty")
        return value

    @model_validator(mode="after")
    def _best_of_is_n(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n ({self.n}): ranking best_of candidates is not supported")
        return self

    @model_validator(mode="after")
    def _choices_in_bounds(self):
        if len(self.prompts) * self.n > MAX_CHOICES:
            raise ValueError(f"prompts x n is {len(self.prompts)} x {self.n}; at most {MAX_CHOICES} choices a request")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or a batch (OpenAI's list of strings or of token-id lists)."""
        prompt = self.prompt
        return list(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) \
            else [prompt]


class FunctionCall(_OpenAIModel):
    name: str
    arguments: str  # JSON text, as the reply carried it


class ToolCall(_OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_OpenAIModel):
    # What a client sends back of an earlier reply (``message.model_dump()``): its
    # ``refusal``, ``annotations``, ... at null are nothing to render.
    _NEUTRAL_NULLS: ClassVar[frozenset[str]] = frozenset({
        "refusal", "annotations", "audio", "function_call"})
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None  # null only for an assistant's (tool-call) reply
    name: str | None = None
    tool_call_id: str | None = None  # a tool message answers this call (kept for the client; not rendered)
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls (``tool_calls.render_messages``)

    @model_validator(mode="after")
    def _calls_are_an_assistants(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        return self

    @model_validator(mode="after")
    def _content_unless_assistant(self):
        if self.content is None:
            if self.role != "assistant":
                raise ValueError(f"a {self.role} message needs content")
            self.content = ""
        return self

    @field_validator("content")
    @classmethod
    def _text_only(cls, value):
        if isinstance(value, list):
            if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in value):
                raise ValueError("only text content parts are supported")
            value = "".join(part["text"] for part in value)
        return value


class FunctionDefinition(_OpenAIModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: a call takes no arguments
    strict: bool | None = None  # false: the schema as written; else closed to the keys it names (tool_calls.py)


class Tool(_OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_OpenAIModel):
    name: str


class NamedToolChoice(_OpenAIModel):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # with "required" or "auto": more than one call allowed

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        return self

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self):
        if self.tool_choice is not None and not self.tools:
            raise ValueError("tool_choice needs tools")
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools name a function twice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names function '{self.tool_choice.function.name}', which is not in tools")
        return self

    @property
    def grammar_param(self) -> str:
        return "tools" if self.tools and self.tool_choice != "none" else super().grammar_param


class TokenizeRequest(_OpenAIModel):
    """vLLM's ``POST /tokenize``: a prompt, or chat messages as the chat template renders
    them -- the very ids a completion or chat request with them would be given."""

    model: str | None = None  # optional, as vLLM's; checked when given
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    # vLLM's default adds the tokenizer's special tokens; specserve's requests never do,
    # so saying true would describe ids no request gets: only false is accepted. A chat
    # request always ends in the generation prompt: so does this.
    add_special_tokens: Literal[False] = False
    add_generation_prompt: Literal[True] = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_OpenAIModel):
    """vLLM's ``POST /detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0)]]
