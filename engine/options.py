"""Per-request generation options and engine-wide configuration (validated by pydantic).

Unknown fields are rejected, so a typo such as ``max_tokens`` for ``max_new_tokens``
fails loudly with the field named instead of silently using a default.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.model.providers import Device

SpeculativeMode = Literal["none", "prompt_lookup", "draft_model", "mtp", "eagle3", "shared_kv"]
SPECULATIVE_MODES: tuple[str, ...] = SpeculativeMode.__args__
MAX_SPECULATIVE_TOKENS = 16


class GenerationOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = Field(64, ge=1, description="stop after this many new tokens (finish_reason 'length')")
    temperature: float = Field(0.0, ge=0.0, le=100.0, description="0 = greedy")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0 = off")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass; 1 = off")
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0,
                                      description="HF-style penalty on tokens already in the context; 1 = off")
    seed: int | None = Field(None, ge=0, description="sampling seed; same seed + same options = same output")
    stop: tuple[str, ...] = Field((), max_length=16, description="stop strings; excluded from the returned text")
    ignore_eos: bool = False
    logprobs: bool = Field(False, description="return the log-probability of each generated token")
    top_logprobs: int = Field(0, ge=0, le=20, description="also return this many most likely alternatives")
    speculative_mode: SpeculativeMode | None = Field(None, description="override the engine's default mode")
    num_speculative_tokens: int | None = Field(None, ge=1, le=MAX_SPECULATIVE_TOKENS,
                                               description="drafts per round; overrides the engine default")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_tuple(cls, value):
        if value is None:
            return ()
        return (value,) if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not s for s in value):
            raise ValueError("stop strings must be non-empty")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SpeculativeConfig(BaseModel):
    """Engine-wide speculative defaults and which proposers to load."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    default_mode: SpeculativeMode = "none"
    num_speculative_tokens: int = Field(4, ge=1, le=MAX_SPECULATIVE_TOKENS)
    load: tuple[SpeculativeMode, ...] | None = Field(
        None, description="proposers to load at start; None = every one the model bundle provides")
    prompt_lookup_ngram: int = Field(3, ge=1)
    mtp_kv_mode: Literal["hidden_threaded", "cached"] = "hidden_threaded"


class EngineConfig(BaseModel):
    """How the engine runs its models (not per request)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: Device = "auto"
    intra_op_threads: int | None = Field(None, ge=1, description="target's onnxruntime intra-op threads; None = its default")
    thread_spinning: bool = Field(True, description=(
        "let the target's onnxruntime threads spin-wait between runs: fastest when the engine owns the cores, "
        "harmful when other processes (Ray workers) need them in between"))
    proposer_threads: int = Field(1, ge=1, description=(
        "intra-op threads of draft/head sessions: 1 runs them on the calling thread, so they never fight "
        "the target's thread pool for cores (a round alternates between the two)"))
    kv_block_size: int = Field(16, ge=1)
    kv_num_blocks: int = Field(1024, ge=1, description="paged-KV pool size in blocks (shared by all sequences)")
    sliding_window: int | None = Field(None, ge=2, description="keep at most this many KV tokens per sequence")
    sink_tokens: int = Field(0, ge=0, description="first tokens always kept when the window slides")
    max_context: int | None = Field(None, ge=2, description="override the model's context limit (tokens)")
    max_batch_size: int = Field(16, ge=1, description="sequences advanced together per target pass")
    speculative: SpeculativeConfig = SpeculativeConfig()
