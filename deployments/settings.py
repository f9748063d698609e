"""The application's arguments (``args:`` in serve_config.yaml), validated once."""
from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from engine.options import MAX_SPECULATIVE_TOKENS, EngineConfig, SpeculativeMode
from engine.model.providers import Device

PROJECT_ROOT = Path(__file__).resolve().parents[1]


class ServeSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_dir: str = Field("models", description="bundle with manifest.json; a relative path is looked up in the "
                                                 "working directory, then in the project root")
    device: Device = "auto"
    default_mode: SpeculativeMode = "eagle3"
    num_speculative_tokens: int = Field(4, ge=1, le=MAX_SPECULATIVE_TOKENS)
    modes: list[SpeculativeMode] | None = Field(None, description="modes to deploy; None = all the bundle provides")
    prompt_lookup_ngram: int = Field(3, ge=1)
    kv_num_blocks: int = Field(1024, ge=1, description="KV blocks per target replica")
    kv_block_size: int = Field(16, ge=1)
    intra_op_threads: int | None = Field(None, ge=1, description="target onnxruntime threads; None = its default")
    proposer_threads: int = Field(1, ge=1)
    thread_spinning: bool = Field(False, description="onnxruntime spin-waiting; off, since replicas share cores")
    lanes: int = Field(2, ge=1, le=8, description="independent tick loops; >1 overlaps proposing and verifying")
    max_batch: int = Field(32, ge=1, description="sequences one lane advances per tick")
    max_tokens_cap: int | None = Field(None, ge=1, description="largest max_tokens accepted; None = the context")
    proposer_timeout_s: float = Field(5.0, gt=0, description="a proposer call slower than this is abandoned; "
                                      "its sequences run without drafts for a second")
    admission_timeout_s: float = Field(30.0, gt=0, description="how long a request waits for KV before a 503")
    served_model_name: str = "specserve"
    api_key_env: str = Field("SPECSERVE_API_KEY", description="environment variable holding the API key; "
                             "unset or empty = no authentication. The key itself never goes in this config")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest accepted request body")

    deployment_overrides: dict[str, dict] = Field(
        default_factory=dict, description="per-deployment Serve options for programmatic runs (tests, "
        "cluster.local), e.g. {'Eagle3Proposer': {'autoscaling_config': {...}}}; config files use `deployments:`")

    def bundle_dir(self) -> Path:
        path = Path(self.model_dir).expanduser()
        if path.is_absolute() or path.exists():
            return path.resolve()
        return (PROJECT_ROOT / path).resolve()

    def engine_config(self) -> dict:
        return EngineConfig(device=self.device, intra_op_threads=self.intra_op_threads,
                            proposer_threads=self.proposer_threads, thread_spinning=self.thread_spinning,
                            kv_block_size=self.kv_block_size,
                            kv_num_blocks=self.kv_num_blocks).model_dump(mode="json")
