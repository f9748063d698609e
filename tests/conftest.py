"""Shared fixtures: the bundled models (committed under models/) and held-out prompts."""
from __future__ import annotations

import json
import os
import socket
from contextlib import contextmanager
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(args: dict | None = None, env: dict[str, str] | None = None, **ray_options):
    """specserve on a fresh local Ray head (127.0.0.1); yields its base URL and shuts
    Ray down afterwards. ``env`` is set before Ray starts (its workers inherit it)."""
    import ray
    from ray import serve

    from cluster.local import serve_local, start_local_ray

    port = free_port()
    saved = {key: os.environ.get(key) for key in env or {}}
    os.environ.update(env or {})
    try:
        start_local_ray(**ray_options)
        serve_local({"model_dir": "models", "device": "cpu", "default_mode": "eagle3", **(args or {})}, port=port)
        yield f"http://127.0.0.1:{port}"
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        serve.shutdown()
        ray.shutdown()
