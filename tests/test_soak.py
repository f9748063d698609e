"""A short soak (bench/soak.py) in CI: concurrent streams in every mode for 20 s against a real
local server, with no errors, every greedy output token-identical to the engine, and every
KV block back at the end -- leaks and cross-talk that single requests never show."""
from __future__ import annotations

import pytest

from bench.soak import run_soak

from .conftest import running_server

MODES = ("none", "prompt_lookup", "draft_model", "mtp", "eagle3", "shared_kv")


@pytest.fixture(scope="module")
def server():
    with running_server() as url:
        yield url


def test_a_short_soak_in_every_mode_has_no_errors_no_drift_and_no_kv_leak(server):
    summary = run_soak(server, concurrency=8, seconds=20, max_tokens=24, modes=MODES, check_fraction=1.0)
    assert summary["requests_completed"] > 0
    assert summary["errors"] == 0, summary["error_samples"]
    assert summary["identity_checked"] == summary["requests_completed"]
    assert summary["identity_failures"] == 0, summary["identity_failure_samples"]
    kv = summary["kv"]
    assert kv["free_blocks_end"] == kv["free_blocks_start"] == kv["total_blocks"] and kv["sequences_end"] == 0
    assert all(summary["completed_by_mode"][mode] >= 1 for mode in MODES), summary["completed_by_mode"]
