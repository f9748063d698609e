"""A short soak (bench/soak.py) in CI: concurrent streams in every mode for 20 s against a real
local server, with no errors, every greedy output token-identical to the engine, and every
KV block back at the end -- leaks and cross-talk that single requests never show."""
from __future__ import annotations

import socket

import pytest

from bench.soak import run_soak

MODES = ("none", "prompt_lookup", "draft_model", "mtp", "eagle3", "shared_kv")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    """specserve on a fresh local Ray head (127.0.0.1), shut down after the module."""
    import ray
    from ray import serve

    from cluster.local import serve_local, start_local_ray

    port = _free_port()
    start_local_ray()
    try:
        serve_local({"model_dir": "models", "device": "cpu", "default_mode": "eagle3"}, port=port)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_a_short_soak_in_every_mode_has_no_errors_no_drift_and_no_kv_leak(server):
    # 48 prompts: variety enough for 20 s on two cores, with references that take seconds, not minutes.
    summary = run_soak(server, concurrency=8, seconds=20, max_tokens=24, modes=MODES, check_fraction=1.0,
                       num_prompts=48)
    assert summary["requests_completed"] > 0
    assert summary["errors"] == 0, summary["error_samples"]
    assert summary["identity_checked"] == summary["requests_completed"]
    assert summary["identity_failures"] == 0, summary["identity_failure_samples"]
    kv = summary["kv"]
    assert kv["free_blocks_end"] == kv["free_blocks_start"] and kv["sequences_end"] == 0
    assert all(summary["completed_by_mode"][mode] >= 1 for mode in MODES), summary["completed_by_mode"]
