"""A short soak (bench/soak.py) in CI: concurrent streams in every mode for 20 s against a real
local server, every prompt after one shared prefix, with no errors, every greedy output
token-identical to the engine, and every KV block back at the end -- leaks and cross-talk
that single requests never show. The server's KV pool is small (160 blocks of 16 tokens),
so requests also wait for room and cached prefix blocks are evicted and made again."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from bench.soak import run_soak

from .conftest import running_server

KV_BLOCKS = 160

MODES = ("none", "prompt_lookup", "draft_model", "mtp", "eagle3", "shared_kv")


@pytest.fixture(scope="module")
def server():
    with running_server({"engine": {"kv_num_blocks": KV_BLOCKS}}) as url:
        yield url


def test_a_short_soak_in_every_mode_has_no_errors_no_drift_and_no_kv_leak(server):
    summary = run_soak(server, concurrency=8, seconds=12, max_tokens=24, modes=MODES, check_fraction=1.0,
                       shared_prefix=True)
    assert summary["requests_completed"] > 0
    assert summary["errors"] == 0, summary["error_samples"]
    assert summary["identity_checked"] == summary["requests_completed"]
    assert summary["identity_failures"] == 0, summary["identity_failure_samples"]
    kv = summary["kv"]
    assert kv["free_blocks_end"] == kv["free_blocks_start"] == kv["total_blocks"] and kv["sequences_end"] == 0
    assert all(summary["completed_by_mode"][mode] >= 1 for mode in MODES), summary["completed_by_mode"]
    cache = summary["prefix_cache"]
    assert cache["hit_tokens"] > cache["queried_tokens"] / 2  # most of every prefill came from the cache
    # every block is free, or keeps a cached prefix no sequence holds; after a reset all are free
    assert kv["cached_blocks_end"] > 0
    assert httpx.post(f"{server}/reset_prefix_cache", timeout=30).json()["status"] == "ok"
    after = _kv(server)
    assert after["cached_blocks"] == 0 and after["free_blocks"] == KV_BLOCKS and after["sequences"] == 0


def _kv(server: str) -> dict:
    return httpx.get(f"{server}/specserve/status", timeout=30).json()["kv"]


def test_a_client_gone_while_its_choices_wait_for_kv_leaves_no_blocks_held(server):
    """Five long streams hold 130 of the 160 blocks; an n=2 request (26 blocks a choice)
    fits one choice but waits for room for both, holding nothing, and its client gives up:
    no choice is ever admitted (not even when room comes), and every block is back when
    the streams end -- also the KV manager's grant, had its wait outlived the request."""
    body = {"model": "specserve", "prompt": "def main():", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "speculative_mode": "none"}

    def hog() -> None:
        with httpx.stream("POST", f"{server}/v1/completions", json={**body, "stream": True}, timeout=120) as response:
            for _ in response.iter_lines():
                pass

    hogs = [threading.Thread(target=hog) for _ in range(5)]
    for thread in hogs:
        thread.start()
    deadline = time.monotonic() + 30
    while _kv(server)["sequences"] < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _kv(server)["free_blocks"] == KV_BLOCKS - 5 * 26
    with pytest.raises(httpx.ReadTimeout):  # the client leaves while its second choice waits
        httpx.post(f"{server}/v1/completions", json={**body, "n": 2}, timeout=httpx.Timeout(30, read=1.5))
    seen = []
    while any(thread.is_alive() for thread in hogs):
        seen.append(_kv(server)["sequences"])
        time.sleep(0.1)
    assert max(seen) <= 5  # neither choice ever ran
    for thread in hogs:
        thread.join(timeout=120)
    deadline = time.monotonic() + 30
    while (kv := _kv(server))["free_blocks"] != KV_BLOCKS and time.monotonic() < deadline:
        time.sleep(0.1)
    assert kv["free_blocks"] == KV_BLOCKS and kv["sequences"] == 0
