"""OpenAI-compatible request shapes and errors (the subset specserve serves).

Requests are strict: a field this server does not know is a 400 naming the field,
rather than a silently ignored setting. Fields OpenAI defines but specserve does not
implement are accepted only at their neutral value (``n=1``, ``echo=false``, penalties
0, ...), so a client that sends defaults works and one that relies on them is told.
Extensions (vLLM-style extra body fields): ``speculative_mode``,
``num_speculative_tokens`` (the most drafts per round), ``adaptive_speculation``,
``top_k``, ``repetition_penalty``, ``ignore_eos``, ``return_token_ids`` (each choice, and each streamed chunk, carries ``token_ids``); every
response carries the request's speculative statistics under ``speculative``.
The response bodies and SSE chunks are built in ``openai_responses.py``.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.options import MAX_SPECULATIVE_TOKENS, GenerationOptions, SpeculativeMode


class ApiError(Exception):
    """An error the client should see, with its HTTP status and OpenAI error type."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(examples=["specserve"])
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: Literal[0, 0.0] = 0.0
    frequency_penalty: Literal[0, 0.0] = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions
    top_k: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    ignore_eos: bool = False
    speculative_mode: SpeculativeMode | None = None
    num_speculative_tokens: int | None = Field(None, ge=1, le=MAX_SPECULATIVE_TOKENS)
    adaptive_speculation: bool | None = None  # False pins every round to num_speculative_tokens drafts
    return_token_ids: bool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value):
        if value:
            raise ValueError("logit_bias is not supported by this server")
        return value

    def options(self, max_tokens: int, logprobs: bool, top_logprobs: int) -> GenerationOptions:
        return GenerationOptions(max_new_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                                 top_k=self.top_k, repetition_penalty=self.repetition_penalty, seed=self.seed,
                                 stop=tuple(self.stop or ()), ignore_eos=self.ignore_eos, logprobs=logprobs,
                                 top_logprobs=top_logprobs, speculative_mode=self.speculative_mode,
                                 num_speculative_tokens=self.num_speculative_tokens,
                                 adaptive_speculation=self.adaptive_speculation)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(examples=["def read_config(path):"])
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: Literal[False] = False
    best_of: Literal[1] | None = None
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError("batched prompts are not supported: send one prompt per request")
            value = value[0]
        if isinstance(value, (str, list)) and len(value) == 0:
            raise ValueError("prompt must not be empty")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]]
    name: str | None = None

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
