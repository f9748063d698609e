"""Autoscaling on a real local Ray Serve: under load from concurrent streams a proposer
deployment scales up from one replica, the new replica really drafts for sequences (the
router sees its drafts, and the replica itself counts them), and the deployment scales
back down when the load stops -- with every request still token-identical to the
in-process engine (sequences that land on the new replica re-sync their drafting state;
none of that can change the output)."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engine import GenerationOptions

from .conftest import running_server

FAST_SCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 0.25, "metrics_interval_s": 0.5,
                "look_back_period_s": 2, "upscale_delay_s": 1, "downscale_delay_s": 4}
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def server():
    # The target "autoscales" between 1 and 1 replica: an autoscaled deployment's rounds go
    # through Serve (its autoscaler counts them), so this module also covers that path.
    with running_server({"deployment_overrides": {"Eagle3Proposer": {"autoscaling_config": FAST_SCALING},
                                                  "TargetModel": {"autoscaling_config": {"min_replicas": 1,
                                                                                         "max_replicas": 1}}}}) as url:
        yield url


def _running_replicas(deployment: str) -> int:
    from ray import serve

    status = serve.status().applications["specserve"].deployments[deployment]
    return status.replica_states.get("RUNNING", 0)


def _stream(server: str, prompt: str) -> list[int]:
    body = {"model": "specserve", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True, "speculative_mode": "eagle3", "return_token_ids": True}
    ids = []
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                ids += [t for c in json.loads(line[6:])["choices"] for t in c.get("token_ids", [])]
    return ids


def _wait_for(predicate, timeout_s: float) -> bool:
    """Poll ``predicate`` every 0.5 s until it holds or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return False


def _drafted_by(first: str) -> dict[str, int]:
    """Eagle3 sequence-rounds the router got drafts for, by proposer replica other than ``first``."""
    from ray import serve

    stats = serve.get_deployment_handle("Router", "specserve").scheduler_stats.remote().result()
    return {replica: rounds for replica, rounds in stats["proposer_replicas"].get("eagle3", {}).items()
            if replica != first and rounds > 0}


def test_a_proposer_deployment_scales_up_under_load_and_back_down(server, bundle_engine, heldout_prompts):
    from ray import serve

    assert _running_replicas("Eagle3Proposer") == 1
    proposer = serve.get_deployment_handle("Eagle3Proposer", "specserve")
    first = proposer.transport_stats.remote().result()["replica"]
    stop, results, peak = threading.Event(), [], [1]

    def client(i: int) -> None:
        while not stop.is_set():
            prompt = heldout_prompts[i % len(heldout_prompts)]
            results.append((prompt, _stream(server, prompt)))
            i += 7

    with ThreadPoolExecutor(12) as pool:
        for i in range(12):
            pool.submit(client, i)
        scaled_up = _wait_for(lambda: peak.append(_running_replicas("Eagle3Proposer")) or max(peak) >= 2, 60)
        # keep the load on until the new replica has drafted for sequences
        served = scaled_up and _wait_for(lambda: bool(_drafted_by(first)), 30)
        second = next(iter(_drafted_by(first)), None)
        # ask that replica itself (the hint pins the call to it) while it is still up
        own = proposer.transport_stats.remote(replica_hint=second).result() if second else {}
        stop.set()
    assert scaled_up, f"Eagle3Proposer never got a second replica (peak {max(peak)})"
    assert served, "the second Eagle3Proposer replica never drafted for a sequence"
    assert own["replica"] == second and own["drafted_rounds"] > 0, own
    assert _wait_for(lambda: _running_replicas("Eagle3Proposer") == 1, 60), "it never scaled back down"
    assert len(results) >= 12
    assert serve.get_deployment_handle("TargetModel", "specserve").kv_usage.remote().result()["serve_steps"] > 0
    expected = {}
    for prompt, ids in results:
        if prompt not in expected:
            expected[prompt] = bundle_engine.generate(prompt, GenerationOptions(
                max_new_tokens=NEW_TOKENS, ignore_eos=True, speculative_mode="none")).token_ids
        assert ids == expected[prompt]
