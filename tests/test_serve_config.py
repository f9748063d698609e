"""The shipped Serve configs do what the README says: each passes Serve's own schema (what
``serve deploy`` checks before anything runs), its ``args`` are valid settings, and its
``deployments:`` name only deployments the builder makes (Serve would reject the
application at deploy time otherwise, on a cluster, long after a typo was made). And
``serve run serve_config.yaml`` -- the design card's command -- really serves: Serve's
CLI in its own process, its own local Ray, the official client against it."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from specserve.deployments.builder import deployed_modes
from specserve.deployments.settings import ServeSettings
from specserve.engine import GenerationOptions
from specserve.engine.model.bundle import Bundle
from specserve.engine.speculative.proposers.registry import PROPOSER_MODES

from .conftest import free_port

ROOT = Path(__file__).resolve().parents[1]


def _kuberay_serve_config() -> dict:
    service = yaml.safe_load((ROOT / "cluster/kuberay-rayservice.yaml").read_text())
    return yaml.safe_load(service["spec"]["serveConfigV2"])


CONFIGS = {
    "serve_config.yaml": lambda: yaml.safe_load((ROOT / "serve_config.yaml").read_text()),
    "cluster/serve_config.gpu.yaml": lambda: yaml.safe_load((ROOT / "cluster/serve_config.gpu.yaml").read_text()),
    "cluster/kuberay-rayservice.yaml": _kuberay_serve_config,
}


@pytest.mark.parametrize("name", CONFIGS)
def test_a_shipped_config_passes_serves_schema_and_names_only_deployments_the_builder_makes(name):
    from ray.serve.schema import ServeDeploySchema

    config = CONFIGS[name]()
    ServeDeploySchema.model_validate(config)
    for app in config["applications"]:
        assert app["import_path"] == "specserve.deployments.builder:build_app"
        settings = ServeSettings.model_validate(app.get("args", {}))
        modes = deployed_modes(settings, Bundle.load(settings.bundle_dir()))
        made = {"Router", "TargetModel"} | {PROPOSER_MODES[mode].deployment for mode in modes}
        named = {deployment["name"] for deployment in app.get("deployments", [])}
        assert named <= made, f"{name} configures deployments the builder does not make: {named - made}"
        assert "TargetModel" in named and "Router" in named


def test_serve_run_serves_the_shipped_config(tmp_path, default_engine):
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port  # the shipped file's 8000 may be taken here
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    serve_cli = Path(sys.executable).parent / "serve"
    log = tmp_path / "serve_run.log"  # a file, not a pipe: Ray's forwarded logs would fill a pipe and block it
    # --address local: a Ray of its own, never one another test (or a developer) left running
    with open(log, "w") as out:
        process = subprocess.Popen([str(serve_cli), "run", "--address", "local", str(path)], cwd=ROOT, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert process.poll() is None, f"serve run exited early:\n{log.read_text()[-4000:]}"
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve run did not become healthy in 240 s"
            time.sleep(2)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is the capital of Japan?"}]
        response = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16,
                                                  temperature=0, extra_body={"return_token_ids": True})
        expected = default_engine.chat(messages, GenerationOptions(max_new_tokens=16, temperature=0))
        assert response.model_extra["speculative"]["mode"] == default_engine.default_mode  # the config's "auto"
        assert response.choices[0].model_extra["token_ids"] == expected.token_ids
        assert response.choices[0].message.content == "The capital of Japan is Tokyo."
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)  # as Ctrl-C: Serve and its Ray shut down
            try:
                # Usually seconds; when Serve's graceful shutdown stalls (seen in CI), the kill
                # below ends it: the test is about serving, and a long wait costs CI minutes.
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(process.pid, signal.SIGKILL)  # whatever of its Ray is left in its process group
        except ProcessLookupError:
            pass
        process.wait(timeout=30)


try:  # resolved here, in the parent: the child between fork and exec must not import
    _PRCTL = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except OSError:
    _PRCTL = None
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child: SIGTERM it if the test process dies first (a CI timeout), so no
    ``serve run`` and its Ray outlive the test run. Linux only; elsewhere a no-op."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
