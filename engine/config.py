"""The engine's configuration: one pydantic model for the in-process ``Engine`` and the
Ray Serve deployments (``deployments/settings.py`` embeds it, never re-declares it).

Every field means the same thing in both places and has the same default, so a
request behaves the same in-process and through the server. Where the right value
depends on the process layout (spin-waiting threads), the field takes ``"auto"`` and
one documented rule resolves it.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from specserve.engine.kv.replica_choice import ReplicaRouting
from specserve.engine.options import MAX_SPECULATIVE_TOKENS, SpeculativeMode

Device = Literal["auto", "cpu", "cuda"]  # where onnxruntime sessions run (``model.providers`` resolves "auto")
# How an onnxruntime session's pool threads wait for work: spinning between runs too, spinning
# within a run only (``session.force_spinning_stop``: they sleep once it ends), or sleeping.
SpinPolicy = Literal["always", "within_run", "never"]

# What ``default_mode="auto"`` picks: the first loaded of these (fastest first on the
# bundled models, docs/benchmarks/); target-only if none is loaded.
AUTO_MODE_PREFERENCE: tuple[str, ...] = ("eagle3", "mtp", "shared_kv", "draft_model")


class SpeculativeConfig(BaseModel):
    """Engine-wide speculative defaults and which proposers to load."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    default_mode: SpeculativeMode | Literal["auto"] = Field(
        "auto", description="mode of a request that names none; 'auto' = the best loaded head "
                            f"({' > '.join(AUTO_MODE_PREFERENCE)}), else target-only")
    num_speculative_tokens: int = Field(4, ge=1, le=MAX_SPECULATIVE_TOKENS, description=(
        "most drafts per round (a request may ask for another maximum)"))
    adaptive: bool = Field(True, description=(
        "pick each round's draft count per sequence (0..the maximum) to minimise the expected time per token "
        "over the batch's requests, from live acceptance and measured verify/draft costs; False drafts the "
        "maximum every round"))
    load: tuple[SpeculativeMode, ...] | None = Field(
        None, description="proposers to load (in-process) or deploy (server); None = every one the bundle provides")
    prompt_lookup_ngram: int = Field(3, ge=1)
    suffix_num_speculative_tokens: int = Field(MAX_SPECULATIVE_TOKENS, ge=1, le=MAX_SPECULATIVE_TOKENS, description=(
        "most drafts per round in suffix mode (a request may ask for another maximum): its drafts are as long as "
        "its matches allow, and the adaptive plan cuts what a round cannot pay for"))
    suffix_max_depth: int = Field(24, ge=2, le=256, description=(
        "suffix decoding's longest match plus draft, in tokens (vLLM's suffix_decoding_max_tree_depth)"))
    suffix_max_spec_factor: float = Field(1.0, gt=0, description=(
        "a match of m tokens drafts at most factor * m + offset tokens"))
    suffix_max_spec_offset: float = Field(0.0, ge=0)
    suffix_min_token_prob: float = Field(0.1, ge=0, le=1, description=(
        "drafting stops where a token's estimated probability (branch counts, multiplied along the draft) "
        "falls below this"))
    suffix_min_match: int = Field(3, ge=2, le=64, description=(
        "shorter suffix matches draft nothing: a 2-token match's first draft is accepted about a third of the "
        "time, which a verify does not pay for (docs/speculative-decoding.md#suffix-decoding)"))
    suffix_max_cached_requests: int = Field(10000, ge=0, description=(
        "earlier suffix-mode outputs a coordinator (the engine, or one router replica) drafts from, oldest "
        "evicted first; 0 drafts from each request's own tokens only"))


class SchedulerConfig(BaseModel):
    """How the round coordinator admits and batches requests (same in-process and served)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_batch_size: int = Field(32, ge=1, description="sequences one lane advances per tick; the rest wait (FIFO)")
    lanes: int = Field(2, ge=1, le=8, description=(
        "independent tick loops whose calls overlap; a sequence joins the first with room (max_batch_size), so a "
        "second one takes what one tick cannot batch; only a transport whose calls can overlap (remote workers) "
        "uses more than one"))
    admission_timeout_s: float = Field(30.0, gt=0, description=(
        "how long a request waits for KV blocks before it fails (HTTP 503 on the server)"))
    replica_routing: ReplicaRouting = Field("prefix_aware", description=(
        "which target replica admission puts a new sequence on: 'prefix_aware' the one caching the longest prefix "
        "of its prompt while loads are within 8 sequences of each other, else the roomiest (Ray Serve LLM's "
        "prefix-aware router); 'round_robin' each in turn"))
    proposer_timeout_s: float = Field(5.0, gt=0, description=(
        "a proposer call slower than this is abandoned; its rounds go without drafts"))
    proposer_backoff_s: float = Field(1.0, ge=0, description=(
        "after a proposer failure or timeout, its mode's rounds go without drafts for this long"))
    plain_steps: int = Field(8, ge=1, le=64, description=(
        "most rounds a target call runs back to back when it has no drafts (vLLM's num_scheduler_steps): "
        "always when every sequence in it is target-only, and when an adaptive plan drafts nothing and prices "
        "this cheaper than drafting. The worker feeds its own tokens, so a round's bookkeeping (and, on the "
        "server, its hop) is paid once per this many tokens; tokens then stream in bursts, and a stop string "
        "wastes at most this many - 1 passes"))
    replan_rounds: int = Field(4, ge=1, le=64, description=(
        "rounds an adaptive plan holds while its target call has the same sequences and draft maxima (each "
        "re-plan that comes out the same holds twice as long, up to 4x this); 1 plans every round, a measurable "
        "tax on one-stream rounds (docs/adaptive-speculation.md)"))


class EngineConfig(BaseModel):
    """How the engine runs its models and schedules requests (not per request)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: Device = "auto"
    intra_op_threads: int | None = Field(None, ge=1, description="target's onnxruntime intra-op threads; None = its default")
    thread_spinning: bool | Literal["auto", "within_run"] = Field("auto", description=(
        "let the target's onnxruntime threads spin-wait for work: true, also between runs; 'within_run', "
        "while a run lasts, sleeping once it ends; false, never. 'auto': true when the engine has the "
        "process's cores to itself (the in-process Engine), 'within_run' in a Ray Serve worker, whose "
        "neighbours (the router, the HTTP proxy) need the cores between its runs: a batched step spinning "
        "within its run takes about half the time of one whose threads sleep between ops "
        "(docs/benchmarks/worker_threads-*.md)"))
    proposer_threads: int = Field(1, ge=1, description=(
        "intra-op threads of draft/head sessions: 1 runs them on the calling thread, so they never fight "
        "the target's thread pool for cores (a round alternates between the two)"))
    int8_heads: bool = Field(True, description=(
        "on CPU, run a proposer head's int8 graph (model.int8.onnx beside its model.onnx, when present): its "
        "weight products in int8, a quarter of the bytes to read each step (docs/models.md measures the "
        "gain). Drafts change a little, output never: the target verifies every draft. On CUDA the float "
        "graph runs"))
    kv_block_size: int = Field(16, ge=1)
    kv_num_blocks: int = Field(1024, ge=1, description="paged-KV pool size in blocks (per target replica)")
    sliding_window: int | None = Field(None, ge=2, description=(
        "keep at most this many KV tokens per sequence; speculative modes are refused with it"))
    sink_tokens: int = Field(0, ge=0, description="first tokens always kept when the window slides")
    prefix_caching: bool | None = Field(None, description=(
        "keep full KV blocks of final tokens after their sequence ends and share them with later prompts that "
        "start with the same tokens (vLLM's automatic prefix caching). None: on, unless sliding_window is set "
        "(a window evicts from the middle of a prompt); true with a window is refused"))
    max_context: int | None = Field(None, ge=2, description="override the model's context limit (tokens)")
    target_format: Literal["auto", "exact", "fast"] = Field("auto", description=(
        "the target's graph family (docs/models.md, formats): 'fast' computes a converted GGUF's own blocks "
        "with int8 activations in row-invariant graphs: ~1.5x the tokens/s of 'exact' at batch 1, lossless at "
        "any batch (checked at load; a CPU that fails the check is served 'exact'), closer to float32 than "
        "llama.cpp; 'exact' computes the file's weights in float32 (logits within 2.5e-4 of transformers'); "
        "'auto' (the default): 'fast' where the bundle has it (a converted GGUF, the default model), else "
        "'exact'"))
    in_place_kv: bool = Field(True, description=(
        "run calls on a model's in-place graphs where it ships them (model.inplace.onnx at batch 1; the fast "
        "format's at any batch): one preallocated KV buffer per sequence that the session writes in place, so no "
        "call copies the past (docs/benchmarks/ measures the saving)"))
    in_place_threads: int | None = Field(None, ge=1, description=(
        "onnxruntime threads of the target's in-place graph, which serves its calls at batch 1; None = "
        "intra_op_threads. More than one makes them spin within a run (never after it) even where the target's "
        "threads otherwise sleep, as in a Serve replica's worker: there a lone sequence's calls (a lightly "
        "loaded replica) may use cores beyond the worker's reservation, and batched calls keep to it"))
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()

    @model_validator(mode="after")
    def _caching_needs_full_attention(self) -> "EngineConfig":
        if self.prefix_caching and self.sliding_window is not None:
            raise ValueError("prefix_caching needs a full-attention KV cache; it cannot be on with sliding_window "
                             "(leave it unset, or false)")
        return self

    @property
    def caches_prefixes(self) -> bool:
        """Resolve ``prefix_caching``: on unless set false or a sliding window is set."""
        return self.sliding_window is None if self.prefix_caching is None else self.prefix_caching

    def spinning(self, owns_cores: bool) -> SpinPolicy:
        """Resolve ``thread_spinning``: ``owns_cores`` is True for the in-process engine."""
        setting = self.thread_spinning
        if setting == "auto":
            return "always" if owns_cores else "within_run"
        if setting == "within_run":
            return "within_run"
        return "always" if setting else "never"
