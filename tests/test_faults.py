"""Faults on a real local Ray Serve: a proposer replica, the target replica and the KV
manager are killed with ``ray.kill`` in the middle of a stream. Each stream must still
deliver exactly the in-process engine's greedy tokens -- nothing lost, nothing
duplicated -- every KV block must come back, and a recovered fault is counted, in the
router and in Prometheus. A dead target's prefix cache is gone with it; a restarted KV
manager gets the live target's cached prefixes back. (Its own Ray instance: the kills
must not disturb the other integration tests.)"""
from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from engine import GenerationOptions

from .conftest import local_metrics_url, running_server

NEW_TOKENS = 160


@pytest.fixture(scope="module")
def server():
    with running_server({"engine": {"scheduler": {"proposer_timeout_s": 2.0}}},
                        metrics_report_interval_ms=500) as url:
        yield url


@pytest.fixture(scope="module")
def metrics_url(server) -> str:
    return local_metrics_url()


def _handle(name: str):
    from ray import serve

    return serve.get_deployment_handle(name, "specserve")


def _replica_actor(deployment: str, replica_id: str):
    import ray
    from ray.serve._private.common import REPLICA_ID_FULL_ID_STR_PREFIX

    return ray.get_actor(f"{REPLICA_ID_FULL_ID_STR_PREFIX}specserve#{deployment}#{replica_id}", namespace="serve")


def _stream_with_fault(server: str, prompt: str, mode: str, fault) -> list[int]:
    """Stream greedily; after a few chunks run ``fault()``; return every token id."""
    body = {"model": "specserve", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True, "speculative_mode": mode, "return_token_ids": True}
    ids, chunks = [], 0
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=180) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                ids += choice.get("token_ids", [])
            chunks += 1
            if chunks == 3:
                fault()
    return ids


def _cached_tokens(server: str, prompt: str, bundle_engine) -> int:
    """A short greedy request: its output must be the engine's; returns its cached tokens."""
    response = httpx.post(f"{server}/v1/completions", timeout=60, json={
        "model": "specserve", "prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True})
    assert response.status_code == 200, response.text
    expected = bundle_engine.generate(prompt, GenerationOptions(max_new_tokens=8, temperature=0)).token_ids
    assert response.json()["choices"][0]["token_ids"] == expected
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _expected(bundle_engine, prompt: str) -> list[int]:
    options = GenerationOptions(max_new_tokens=NEW_TOKENS, ignore_eos=True, speculative_mode="none")
    return bundle_engine.generate(prompt, options).token_ids


def _settled_kv(timeout_s: float = 60.0) -> dict:
    """Poll (up to ``timeout_s``) until every KV block is free and no sequence is left."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            usage = _handle("Router").kv_usage.remote().result()
            if usage["free_blocks"] == usage["total_blocks"] and usage["sequences"] == 0:
                return usage
        except Exception:  # noqa: BLE001 - the KV manager may be restarting
            usage = {}
        if time.monotonic() > deadline:
            return usage
        time.sleep(0.5)


def _exported_faults(metrics_url: str, timeout_s: float = 30.0) -> dict[tuple[str, str], float]:
    """``ray_specserve_recovered_faults_total`` by (kind, mode), polled until a series
    appears (workers report every 500 ms here) or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        faults: dict[tuple[str, str], float] = {}
        for line in httpx.get(metrics_url, timeout=10).text.splitlines():
            if line.startswith("ray_specserve_recovered_faults_total{"):
                labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
                key = (labels.get("kind", ""), labels.get("mode", ""))
                faults[key] = faults.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        if faults or time.monotonic() > deadline:
            return faults
        time.sleep(0.5)


def test_health_checks_run_the_real_models(server):
    for name in ("TargetModel", "DraftModelProposer", "MtpProposer", "Eagle3Proposer", "SharedKvProposer"):
        assert _handle(name).check_health.remote().result() is None
    assert _handle("TargetModel").kv_usage.remote().result()["health_probes"] >= 1


def test_a_killed_proposer_replica_costs_speed_not_tokens(server, metrics_url, bundle_engine, heldout_prompts):
    import ray

    before = _handle("Router").scheduler_stats.remote().result()["recovered_faults"]

    def kill_proposer():
        replica = _handle("Eagle3Proposer").transport_stats.remote().result()["replica"]
        ray.kill(_replica_actor("Eagle3Proposer", replica), no_restart=True)

    ids = _stream_with_fault(server, heldout_prompts[0], "eagle3", kill_proposer)
    assert ids == _expected(bundle_engine, heldout_prompts[0])
    usage = _settled_kv()
    assert usage["free_blocks"] == usage["total_blocks"] and usage["sequences"] == 0
    # the lost proposer calls were logged and counted, not swallowed: in the router ...
    after = _handle("Router").scheduler_stats.remote().result()["recovered_faults"]
    lost = {kind: after.get(kind, 0) - before.get(kind, 0) for kind in ("proposer_failed", "proposer_timeout")}
    assert sum(lost.values()) >= 1, after
    # ... and in Prometheus, the series the Grafana dashboard plots
    exported = _exported_faults(metrics_url)
    assert sum(exported.get((kind, "eagle3"), 0) for kind in lost) >= 1, exported


def test_a_killed_target_replica_is_replaced_and_the_stream_re_prefilled(server, bundle_engine, heldout_prompts):
    import ray

    def kill_target():
        replica = _handle("TargetModel").kv_usage.remote().result()["replica"]
        ray.kill(_replica_actor("TargetModel", replica), no_restart=True)

    _cached_tokens(server, heldout_prompts[4], bundle_engine)
    assert _cached_tokens(server, heldout_prompts[4], bundle_engine) > 0  # cached on the replica about to die
    ids = _stream_with_fault(server, heldout_prompts[1], "mtp", kill_target)
    assert ids == _expected(bundle_engine, heldout_prompts[1])  # no token lost or duplicated
    usage = _settled_kv()
    assert usage["replicas"] == 1 and usage["free_blocks"] == usage["total_blocks"]  # the dead pool is gone
    assert _cached_tokens(server, heldout_prompts[4], bundle_engine) == 0  # and its cache with it


def test_a_killed_kv_manager_is_restarted_and_no_request_returns_wrong_text(server, bundle_engine, heldout_prompts):
    import ray

    def kill_kv_manager():
        ray.kill(_handle("TargetModel").describe.remote().result()["kv_manager"], no_restart=True)

    _cached_tokens(server, heldout_prompts[3], bundle_engine)  # cached on the target, named in the ledger
    ids = _stream_with_fault(server, heldout_prompts[2], "shared_kv", kill_kv_manager)
    assert ids == _expected(bundle_engine, heldout_prompts[2])  # the running stream never needed it
    deadline, statuses = time.monotonic() + 90, []
    while time.monotonic() < deadline:  # new requests: 503 while it restarts, then served again
        response = httpx.post(f"{server}/v1/completions", timeout=60, json={
            "model": "specserve", "prompt": heldout_prompts[3], "max_tokens": 16, "temperature": 0,
            "return_token_ids": True})
        statuses.append(response.status_code)
        if response.status_code == 200:
            expected = bundle_engine.generate(heldout_prompts[3], GenerationOptions(max_new_tokens=16)).token_ids
            assert response.json()["choices"][0]["token_ids"] == expected
            # the new ledger learned the target's cached blocks when it re-registered
            assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            break
        assert response.status_code == 503 and response.json()["error"]["message"], response.text
        time.sleep(1)  # a 503 means "retry later": one try a second, for at most the 90 s above
    assert statuses[-1] == 200, statuses
    usage = _settled_kv()
    assert usage["free_blocks"] == usage["total_blocks"] and usage["sequences"] == 0


def test_a_killed_router_leaks_no_kv_block_and_its_replacement_serves(server, bundle_engine, heldout_prompts):
    """The router holds its requests' sequences; killed mid-stream, its lease lapses and
    the KV manager reclaims them: every block comes back, and the restarted router serves."""
    import ray

    def kill_router():
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "#Router#" in a["name"]]
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)

    ids: list[int] = []
    try:
        ids = _stream_with_fault(server, heldout_prompts[5], "prompt_lookup", kill_router)
    except (httpx.HTTPError, AssertionError):
        pass  # the stream died with its router: a clean error or a cut connection, never a hang
    assert len(ids) < NEW_TOKENS
    deadline, served = time.monotonic() + 120, False
    while not served and time.monotonic() < deadline:
        try:
            _cached_tokens(server, heldout_prompts[6], bundle_engine)  # asserts the engine's tokens
            served = True
        except (httpx.HTTPError, AssertionError):
            time.sleep(1)
    assert served, "no router served again"
    usage = _settled_kv(timeout_s=60)
    assert usage["free_blocks"] == usage["total_blocks"] and usage["sequences"] == 0, usage
    assert usage["reclaimed"] >= 1
