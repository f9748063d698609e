"""The application's arguments (``args:`` in serve_config.yaml), validated once.

How the engine runs -- device, threads, KV pool, scheduler, speculative defaults and
which proposers to deploy -- is ``engine.config.EngineConfig``, embedded whole under
``engine:``: the in-process ``Engine`` and the server read the same fields with the same
defaults, so a request behaves the same in both. The fields here exist only when serving.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from specserve.engine.config import EngineConfig

from specserve.engine.model.default_model import DATA_HOME, default_model_dir


class ServeSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_dir: str | None = Field(None, description="bundle with manifest.json (None: the default model, "
                                  "SmolLM2-135M-Instruct, or $SPECSERVE_MODEL); a relative path is looked up in the "
                                  "working directory, then in the data home: the checkout, or $SPECSERVE_HOME, "
                                  "default ~/.local/share/specserve")
    engine: EngineConfig = Field(default_factory=EngineConfig, description=(
        "the engine's configuration (engine/config.py); `engine.speculative.load` = the proposer modes to "
        "deploy (None = every one the bundle provides), `engine.scheduler.lanes` = the router's tick loops"))
    max_tokens_cap: int | None = Field(None, ge=1, description="largest max_tokens accepted; None = the context")
    served_model_name: str | None = Field(None, description=(
        "the model id of /v1/models and of responses; None = the bundle's name (its manifest's, else its directory's)"))
    api_key_env: str = Field("SPECSERVE_API_KEY", description="environment variable holding the API key; "
                             "unset or empty = no authentication. The key itself never goes in this config")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest accepted request body")
    stream_interval: int = Field(1, ge=1, description=(
        "stream a request's tokens in writes of at least this many (the first and the last go at once), as "
        "vLLM's --stream-interval: 1 sends every round's tokens as they commit; more saves the router and "
        "the HTTP proxy a message per round per request (docs/benchmarks/ measures the gain)"))
    stream_writes_per_s: float | None = Field(250.0, gt=0, description=(
        "the router's budget of stream writes per second: while it writes more, each stream waits its share, "
        "(open streams - 1) / budget, between writes (never for its first or last tokens), so at load a "
        "write carries several rounds' tokens and the router and the HTTP proxy are not swamped by one "
        "message per round per stream; below the budget, and for a lone stream, nothing waits. "
        "None = no budget (every round's tokens as they commit, or per stream_interval)"))

    stream_events: Literal["round", "token"] = Field("round", description=(
        "how a stream write goes out: 'round' as one SSE event per choice holding the tokens it carries (a "
        "round's, or the rounds a write holds: text joined, token ids and logprobs as lists, as an OpenAI chunk "
        "may carry several tokens); 'token' as one event per token, for clients that count events as tokens"))

    deployment_overrides: dict[str, dict] = Field(
        default_factory=dict, description="per-deployment Serve options for programmatic runs (tests, "
        "cluster.local), e.g. {'Eagle3Proposer': {'autoscaling_config': {...}}}; config files use `deployments:`")

    def bundle_dir(self) -> Path:
        if self.model_dir is None:
            return default_model_dir().resolve()
        path = Path(self.model_dir).expanduser()
        if path.is_absolute() or path.exists():
            return path.resolve()
        return (DATA_HOME / path).resolve()
