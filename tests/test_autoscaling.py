"""Autoscaling on a real local Ray Serve, on the replicas' own load: under concurrent
streams the target deployment and a proposer deployment each go from one replica to two,
each new replica really serves sequences -- over direct calls to its worker, never
through Serve's request path -- and when the load stops each scales back to one, its
draining replica's sequences finishing first. Every request stays token-identical to the
in-process engine (sequences that land on a new proposer replica re-sync their drafting
state, and one on a target replica that goes is re-prefilled elsewhere: neither can
change the output)."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from specserve.deployments.autoscaling import ReplicaLoadPolicy, replica_load_autoscaling
from specserve.engine import GenerationOptions

from .conftest import running_server

# One replica per 3 sequences: 12 streams want 4, capped at 2. Metrics every 0.5 s
# (Serve's default is 10 s), looked back on over 2 s, 1 s before scaling up, 4 s down.
FAST = {"metrics_interval_s": 0.5, "look_back_period_s": 2, "upscale_delay_s": 1, "downscale_delay_s": 4}
TARGET_SCALING = replica_load_autoscaling(1, 2, target_sequences=3, target_kv_fraction=0.8, **FAST)
PROPOSER_SCALING = replica_load_autoscaling(1, 2, target_sequences=3, **FAST)
NEW_TOKENS = 32
STREAMS = 12


def _context(aggregated_metrics: dict, target_num_replicas: int = 1):
    """Serve's own ``AutoscalingContext``, as its controller hands it to a policy."""
    from ray.serve._private.common import DeploymentID
    from ray.serve.config import AutoscalingContext

    return AutoscalingContext(
        deployment_id=DeploymentID(name="TargetModel", app_name="specserve"), deployment_name="TargetModel",
        app_name="specserve", current_num_replicas=2, target_num_replicas=target_num_replicas, running_replicas=[],
        total_num_requests=0.0, total_queued_requests=0.0, aggregated_metrics=aggregated_metrics, raw_metrics=None,
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4, policy_state={},
        last_scale_up_time=None, last_scale_down_time=None, current_time=None, config=None)


def test_the_policy_wants_replicas_for_the_sequences_or_kv_blocks_its_replicas_report():
    policy = ReplicaLoadPolicy(target_sequences=8, target_kv_fraction=0.5)
    assert policy(_context({}, target_num_replicas=3))[0] == 3  # nothing reported yet: keep what Serve wants
    light = {"sequences": {"a": 3, "b": 1}, "kv_blocks_used": {"a": 100, "b": 20},
             "kv_blocks_total": {"a": 1024, "b": 1024}}
    assert policy(_context(light))[0] == pytest.approx(0.5)     # 4 sequences of 8 a replica
    crowded = {**light, "kv_blocks_used": {"a": 1000, "b": 1000}}
    assert policy(_context(crowded))[0] == pytest.approx(2000 / 512)  # the KV blocks ask for more
    assert ReplicaLoadPolicy(target_sequences=2)(_context(crowded))[0] == pytest.approx(2)  # sequences only


@pytest.fixture(scope="module")
def server():
    with running_server({"deployment_overrides": {"TargetModel": {"autoscaling_config": TARGET_SCALING},
                                                  "Eagle3Proposer": {"autoscaling_config": PROPOSER_SCALING}}}) as url:
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


def _served_by_others(first_target: str, first_proposer: str) -> tuple[str | None, str | None]:
    """The target and eagle3 replicas other than the first that the router got rounds from."""
    from ray import serve

    stats = serve.get_deployment_handle("Router", "specserve").scheduler_stats.remote().result()
    target = next((r for r, n in stats["target_replicas"].items() if r != first_target and n > 0), None)
    proposer = next((r for r, n in stats["proposer_replicas"].get("eagle3", {}).items()
                     if r != first_proposer and n > 0), None)
    return target, proposer


def test_the_target_and_a_proposer_scale_on_their_own_load_with_direct_calls(server, bundle_engine,
                                                                             heldout_prompts):
    from ray import serve

    assert _running_replicas("TargetModel") == _running_replicas("Eagle3Proposer") == 1
    target = serve.get_deployment_handle("TargetModel", "specserve")
    proposer = serve.get_deployment_handle("Eagle3Proposer", "specserve")
    first_target = target.kv_usage.remote().result()["replica"]
    first_proposer = proposer.transport_stats.remote().result()["replica"]
    stop, results = threading.Event(), []
    peaks = {"TargetModel": 1, "Eagle3Proposer": 1}

    def scaled_up() -> bool:
        for name in peaks:
            peaks[name] = max(peaks[name], _running_replicas(name))
        return min(peaks.values()) >= 2

    def client(i: int) -> None:
        while not stop.is_set():
            prompt = heldout_prompts[i % len(heldout_prompts)]
            results.append((prompt, _stream(server, prompt)))
            i += 7

    with ThreadPoolExecutor(STREAMS) as pool:
        for i in range(STREAMS):
            pool.submit(client, i)
        up = _wait_for(scaled_up, 90)
        # keep the load on until both new replicas have served sequences
        served = up and _wait_for(lambda: all(_served_by_others(first_target, first_proposer)), 60)
        second_target, second_proposer = _served_by_others(first_target, first_proposer)
        # ask those replicas themselves (the hint pins the call to one) while they are still up
        target_own = target.kv_usage.remote(replica_hint=second_target).result() if second_target else {}
        proposer_own = proposer.transport_stats.remote(replica_hint=second_proposer).result() \
            if second_proposer else {}
        stop.set()
    assert up, f"never two replicas of each (peaks {peaks})"
    assert served, f"the new replicas never served a sequence ({_served_by_others(first_target, first_proposer)})"
    # Their rounds went straight to their workers: no target step and only first contacts through Serve
    assert target_own["replica"] == second_target and target_own["steps"] > 0 and target_own["serve_steps"] == 0
    assert proposer_own["replica"] == second_proposer and proposer_own["drafted_rounds"] > 0
    assert proposer_own["calls"] > proposer_own["serve_calls"], proposer_own
    assert _wait_for(lambda: _running_replicas("TargetModel") == _running_replicas("Eagle3Proposer") == 1, 90), \
        "they never scaled back down"
    assert len(results) >= STREAMS
    expected = {}
    for prompt, ids in results:
        if prompt not in expected:
            expected[prompt] = bundle_engine.generate(prompt, GenerationOptions(
                max_new_tokens=NEW_TOKENS, ignore_eos=True, speculative_mode="none")).token_ids
        assert ids == expected[prompt]
    # The replica that went took its pool out of the ledger, every block back
    router = serve.get_deployment_handle("Router", "specserve")
    assert _wait_for(lambda: (lambda u: u["replicas"] == 1 and u["free_blocks"] == u["total_blocks"]
                              and u["sequences"] == 0)(router.kv_usage.remote().result()), 30)
    # and the application serves on, on the replica that stayed
    assert _stream(server, heldout_prompts[0]) == bundle_engine.generate(heldout_prompts[0], GenerationOptions(
        max_new_tokens=NEW_TOKENS, ignore_eos=True, speculative_mode="none")).token_ids
