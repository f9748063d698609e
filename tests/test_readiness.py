"""Readiness on a real local Ray Serve: an application whose target replica cannot be
placed (it asks for a GPU this CPU-only cluster lacks) stays pending for good, and every
route answers anyway -- ``/health``, ``/v1/models`` and the generation routes with a 503
that names the pending deployment and says why, instead of hanging until the client gives
up. (Its own Ray instance: the deployment never becomes healthy.)"""
from __future__ import annotations

import time

import httpx
import pytest

from .conftest import free_port

# A graceful-shutdown budget of 1 s: Serve's shutdown otherwise waits its default 20 s for
# the replica that never started.
GPU_TARGET = {"placement_group_bundles": [{"CPU": 0.01}, {"CPU": 0.5, "GPU": 1}], "graceful_shutdown_timeout_s": 1}


@pytest.fixture(scope="module")
def pending_server():
    import ray
    from ray import serve
    from ray.serve.api import _run

    from specserve.cluster.local import start_local_ray
    from specserve.deployments.builder import build_app

    start_local_ray()
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"log_level": "WARNING"})
        args = {"model_dir": "models/fixture", "served_model_name": "specserve",
                "engine": {"device": "cpu", "speculative": {"default_mode": "eagle3", "load": ["eagle3"]}},
                "deployment_overrides": {"TargetModel": GPU_TARGET}}
        _run(build_app(args), name="specserve", route_prefix="/", _blocking=False)  # it never becomes ready
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:  # until the router itself is up (the HTTP proxy then reaches it)
            try:
                if httpx.get(f"{base}/version", timeout=10).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the router never came up"
            time.sleep(1)
        yield base
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.mark.parametrize("method, path, body", [
    ("GET", "/health", None),
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 4}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
])
def test_a_pending_target_gets_a_503_that_says_why(pending_server, method, path, body):
    # The client's timeout is far below the minutes a pending deployment can stay pending.
    response = httpx.request(method, f"{pending_server}{path}", json=body, timeout=10)
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "not_ready" and error["type"] == "service_unavailable"
    message = error["message"]
    assert "TargetModel" in message and "waits for resources" in message, message
    assert "GPU 1 asked, 0 in the cluster" in message, message
    assert "retry" in message
