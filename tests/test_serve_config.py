"""The shipped Serve configs do what the README says: each passes Serve's own schema (what
``serve deploy`` checks before anything runs), its ``args`` are valid settings, and its
``deployments:`` name only deployments the builder makes (Serve would reject the
application at deploy time otherwise, on a cluster, long after a typo was made). And
``serve run serve_config.yaml`` -- the design card's command -- really serves: Serve's
CLI in its own process, its own local Ray, the official client against it: it is the
default-model server every served test of the default model reads (``tests/serve_run.py``)."""
from __future__ import annotations

from pathlib import Path

import openai
import pytest
import yaml

from specserve.deployments.builder import deployed_modes
from specserve.deployments.settings import ServeSettings
from specserve.engine import GenerationOptions
from specserve.engine.model.bundle import Bundle
from specserve.engine.speculative.proposers.registry import PROPOSER_MODES

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


def test_serve_run_serves_the_shipped_config(default_model_server, default_engine):
    """The session's default-model server is ``serve run serve_config.yaml`` (``tests/serve_run.py``)."""
    client = openai.OpenAI(base_url=f"{default_model_server}/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "What is the capital of Japan?"}]
    response = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16,
                                              temperature=0, extra_body={"return_token_ids": True})
    expected = default_engine.chat(messages, GenerationOptions(max_new_tokens=16, temperature=0))
    assert response.model_extra["speculative"]["mode"] == default_engine.default_mode  # the config's "auto"
    assert response.choices[0].model_extra["token_ids"] == expected.token_ids
    assert response.choices[0].message.content == "The capital of Japan is Tokyo."
