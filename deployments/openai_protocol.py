"""OpenAI-compatible request shapes and errors (the subset specserve serves).

Requests are strict: a field this server does not know is a 400 naming the field,
rather than a silently ignored setting. Fields OpenAI defines but specserve does not
implement are accepted only at their neutral value (``suffix`` null, ``best_of`` = ``n``,
``tools`` null, ...), so a client that sends defaults works and one that relies on them is told.
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

from engine.options import (MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, GenerationOptions, LogitBiasValue, OptionFields,
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


class _SamplingFields(_OpenAIModel, OptionFields):
    """The sampling and speculation fields of a completion or chat request: the engine's
    ``OptionFields`` (top_p, the penalties, min_tokens, ignore_eos and the speculative
    extensions) as they are, and the fields whose wire form or limits are OpenAI's."""

    _NEUTRAL_NULLS: ClassVar[frozenset[str]] = frozenset({
        "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call", "metadata", "store",
        "service_tier", "prediction"})

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
    response_format: dict[str, Any] | None = None  # only plain text: {"type": "text"}
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

    @field_validator("response_format")
    @classmethod
    def _text_format(cls, value):
        if value is not None and value != {"type": "text"}:
            raise ValueError("only response_format {\"type\": \"text\"} is supported by this server")
        return value

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

    def options(self, max_tokens: int, logprobs: bool, top_logprobs: int) -> GenerationOptions:
        """The engine's options for this request: the shared ``OptionFields`` as they are,
        the others from their wire form, and the token budget and logprobs the router
        worked out."""
        shared = {name: getattr(self, name) for name in OptionFields.model_fields}
        return GenerationOptions(**shared, max_new_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
                                 seed=self.seed, stop=self.stop,
                                 logit_bias={int(key): bias for key, bias in (self.logit_bias or {}).items()},
                                 stop_token_ids=tuple(self.stop_token_ids or ()), logprobs=logprobs,
                                 top_logprobs=top_logprobs)


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


class ChatMessage(_OpenAIModel):
    # What a client sends back of an earlier reply (``message.model_dump()``): its
    # ``refusal``, ``tool_calls``, ... at null are nothing to render.
    _NEUTRAL_NULLS: ClassVar[frozenset[str]] = frozenset({
        "refusal", "annotations", "audio", "function_call", "tool_calls"})
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None  # null only for an assistant's (tool-call) reply
    name: str | None = None
    tool_call_id: str | None = None  # a tool message answers this call (kept for the client; not rendered)

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


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        return self


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
