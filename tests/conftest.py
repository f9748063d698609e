"""Shared fixtures: the bundled models (committed under models/) and held-out prompts."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from engine import Engine, EngineConfig, SpeculativeConfig

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(os.environ.get("SPECSERVE_TEST_MODELS", ROOT / "models"))  # override only to try a rebuild
TARGET_DIR = MODELS / "target"
DRAFT_DIR = MODELS / "draft"
# Two intra-op threads: the CI machine has two cores.
CPU_CONFIG = EngineConfig(device="cpu", intra_op_threads=2)


@pytest.fixture(scope="session")
def heldout_prompts() -> list[str]:
    return [p["prompt"] for p in json.loads((ROOT / "tests/data/heldout_prompts.json").read_text())]


@pytest.fixture(scope="session")
def target_engine() -> Engine:
    """The target alone (no proposers loaded besides model-free prompt lookup)."""
    return Engine(TARGET_DIR, CPU_CONFIG.model_copy(update={"speculative": SpeculativeConfig(load=())}))


@pytest.fixture(scope="session")
def bundle_engine() -> Engine:
    """The whole bundle: target, draft model and every head."""
    return Engine(MODELS, CPU_CONFIG)


@pytest.fixture(scope="session")
def draft_engine() -> Engine:
    """The small draft model: cheap stand-in where a test needs any real decoder."""
    return Engine(DRAFT_DIR, CPU_CONFIG)
