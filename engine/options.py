"""Per-request generation options (validated by pydantic).

Unknown fields are rejected, so a typo such as ``max_tokens`` for ``max_new_tokens``
fails loudly with the field named instead of silently using a default.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specserve.engine.grammar.spec import StructuredOutput


SpeculativeMode = Literal["none", "prompt_lookup", "suffix", "draft_model", "mtp", "eagle3", "shared_kv"]
SPECULATIVE_MODES: tuple[str, ...] = SpeculativeMode.__args__
MAX_SPECULATIVE_TOKENS = 16
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
MAX_STOP_TOKEN_IDS = 64

# Constraints both the engine's options and the API's request bodies apply (each to its
# own wire form: a token id as an int here, as a dict key string there).
TokenId = Annotated[int, Field(ge=0)]
LogitBiasValue = Annotated[float, Field(ge=-100.0, le=100.0)]


def checked_stops(stops: tuple[str, ...]) -> tuple[str, ...]:
    """Stop strings, each non-empty (an empty one would stop before every token)."""
    if any(not s for s in stops):
        raise ValueError("stop strings must be non-empty")
    return stops


class OptionFields(BaseModel):
    """Per-request options whose meaning and limits are the same for the in-process
    engine and the OpenAI-compatible API: declared once here, inherited by
    ``GenerationOptions`` and by the API's request bodies, which hand them on as they are."""

    model_config = ConfigDict(extra="forbid")

    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass; 1 = off")
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0,
                                      description="HF-style penalty on tokens already in the context; 1 = off")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description=(
        "subtracted from the logit of every token already generated (not the prompt's), as OpenAI and vLLM do"))
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description=(
        "subtracted from a token's logit once per time it was generated (not counting the prompt)"))
    min_tokens: int = Field(0, ge=0, description=(
        "generate at least this many tokens: until then EOS and stop_token_ids are masked out and stop strings "
        "are not looked for (vLLM's min_tokens)"))
    ignore_eos: bool = False
    speculative_mode: SpeculativeMode | None = Field(None, description="override the engine's default mode")
    num_speculative_tokens: int | None = Field(None, ge=1, le=MAX_SPECULATIVE_TOKENS,
                                               description="most drafts per round; overrides the engine default")
    adaptive_speculation: bool | None = Field(None, description=(
        "choose each round's number of drafts (0..num_speculative_tokens) from live acceptance and measured "
        "costs; False pins it to num_speculative_tokens; None = the engine default, except that a seeded "
        "sampled request keeps num_speculative_tokens fixed so its seed reproduces it"))


class GenerationOptions(OptionFields):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = Field(64, ge=1, description="stop after this many new tokens (finish_reason 'length')")
    temperature: float = Field(0.0, ge=0.0, le=100.0, description="0 = greedy")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0 = off")
    logit_bias: tuple[tuple[TokenId, LogitBiasValue], ...] = Field((), max_length=MAX_LOGIT_BIAS, description=(
        "(token id, bias) pairs added to the logits before anything else (a dict is accepted); -100 bans a "
        "token, 100 all but forces it"))
    seed: int | None = Field(None, ge=0, description="sampling seed; same seed + same options = same output")
    stop: tuple[str, ...] = Field((), max_length=16, description="stop strings; excluded from the returned text")
    stop_token_ids: tuple[TokenId, ...] = Field((), max_length=MAX_STOP_TOKEN_IDS, description=(
        "token ids that end generation (finish_reason 'stop'), ignore_eos or not: the token is in token_ids "
        "but its text is not in the text, as with EOS and vLLM's stop_token_ids"))
    logprobs: bool = Field(False, description="return the log-probability of each generated token")
    top_logprobs: int = Field(0, ge=0, le=20, description="also return this many most likely alternatives")
    prompt_logprobs: int | None = Field(None, ge=0, le=20, description=(
        "also return the log-probability of every prompt token after the first, with this many alternatives "
        "(vLLM's prompt_logprobs; from the prefill's logits); None = off"))
    structured_output: StructuredOutput | None = Field(None, description=(
        "what the output must match (a JSON schema, any JSON object, a regex, one of a list of strings, a Lark or "
        "GBNF grammar): the target's logits are masked by the grammar at every position, drafts included"))

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_tuple(cls, value):
        if value is None:
            return ()
        return (value,) if isinstance(value, str) else value

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _ids_as_tuple(cls, value):
        if value is None:
            return ()
        return tuple(value) if isinstance(value, (list, tuple)) else value  # a string is an error, not digits

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return checked_stops(value)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_as_pairs(cls, value):
        if value is None:
            return ()
        return tuple(sorted(value.items())) if isinstance(value, dict) else value

    @field_validator("logit_bias")
    @classmethod
    def _bias_ids_distinct(cls, value: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
        ids = [token for token, _ in value]
        if len(set(ids)) != len(ids):
            raise ValueError("logit_bias keys must be distinct token ids")
        return value

    @model_validator(mode="after")
    def _min_within_max(self) -> "GenerationOptions":
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_new_tokens ({self.max_new_tokens})")
        return self

    @model_validator(mode="after")
    def _grammar_ends_the_output(self) -> "GenerationOptions":
        """A grammar allows only the end-of-sequence token once its output is complete, so
        an option that hides that token could leave no token at all to choose."""
        if self.structured_output is not None:
            if self.ignore_eos:
                raise ValueError("ignore_eos cannot be combined with structured output: the grammar ends the "
                                 "output with the end-of-sequence token")
            if self.min_tokens:
                raise ValueError("min_tokens cannot be combined with structured output: the grammar decides "
                                 "where the output ends")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
