"""Builds the specserve application (Ray Serve LLM's builder pattern): the deployment
classes are plain Python; this function applies their options and binds them.

``serve run serve_config.yaml`` (or ``serve deploy``) calls ``build_app(args)``; options
under ``deployments:`` in the config override the defaults set here.
"""
from __future__ import annotations

import logging

import ray
from ray import serve
from ray.serve import Application
from ray.serve.config import DeploymentActorConfig, RequestRouterConfig

from engine.errors import ModelLoadError
from engine.model.manifest import BundleManifest
from engine.spec.proposers.registry import MODEL_MODES

from .kv_manager import KVManager
from .proposer import ProposerModel
from .router import RouterIngress
from .settings import ServeSettings
from .target import KV_MANAGER, TargetModel

log = logging.getLogger("specserve.builder")

PROPOSER_DEPLOYMENTS = {"draft_model": "DraftModelProposer", "mtp": "MtpProposer", "eagle3": "Eagle3Proposer",
                        "shared_kv": "SharedKvProposer"}
QUIET = {"enable_access_log": False}  # per-tick calls would log several lines per round
AFFINITY = RequestRouterConfig(request_router_class="deployments.affinity:ReplicaAffinityRouter")


def provided_modes(manifest: BundleManifest) -> list[str]:
    return [m for m in MODEL_MODES if (m == "draft_model" and "draft" in manifest.models) or m in manifest.heads]


def build_app(args: dict | None = None) -> Application:
    settings = ServeSettings.model_validate(args or {})
    bundle = settings.bundle_dir()
    manifest = BundleManifest.load(bundle)
    available = provided_modes(manifest)
    wanted = [m for m in (settings.modes or available) if m in MODEL_MODES]
    missing = [m for m in wanted if m not in available]
    if missing:
        raise ModelLoadError(f"modes {missing} requested but the bundle at {bundle} does not provide them")
    served = {"none", "prompt_lookup", *wanted}
    if settings.default_mode not in served:
        raise ModelLoadError(f"default_mode '{settings.default_mode}' is not among the deployed modes {sorted(served)}")
    settings = settings.model_copy(update={"model_dir": str(bundle)})
    engine_config = settings.engine_config()
    gpu = settings.device == "cuda"

    overrides = settings.deployment_overrides

    def options(name: str, defaults: dict) -> dict:
        """Code defaults, then ``deployment_overrides`` (programmatic runs; a config
        file's ``deployments:`` section overrides both)."""
        merged = {"name": name, **defaults, **overrides.get(name, {})}
        if "autoscaling_config" in overrides.get(name, {}):
            merged.pop("num_replicas", None)  # Serve takes one or the other
        return merged

    target = serve.deployment(TargetModel).options(**options("TargetModel", {
        "num_replicas": 1, "max_ongoing_requests": 2 * settings.lanes,
        "ray_actor_options": {"num_cpus": 0.5, **({"num_gpus": 1} if gpu else {})},
        "request_router_config": AFFINITY, "health_check_period_s": 10, "logging_config": QUIET,
        "deployment_actors": [DeploymentActorConfig(
            name=KV_MANAGER, actor_class=ray.remote(KVManager),
            init_kwargs={"admission_timeout_s": settings.admission_timeout_s},
            actor_options={"num_cpus": 0.05})]}),
    ).bind(str(bundle / manifest.models["target"].directory), engine_config)
    proposers = {
        mode: serve.deployment(ProposerModel).options(**options(PROPOSER_DEPLOYMENTS[mode], {
            "num_replicas": 1, "max_ongoing_requests": 2 * settings.lanes,
            "ray_actor_options": {"num_cpus": 0.25, **({"num_gpus": 0.25} if gpu else {})},
            "request_router_config": AFFINITY, "health_check_period_s": 10, "logging_config": QUIET}),
        ).bind(str(bundle), mode, engine_config)
        for mode in wanted}
    router = serve.deployment(RouterIngress).options(**options("Router", {
        "num_replicas": 1, "max_ongoing_requests": 256, "ray_actor_options": {"num_cpus": 0.25}}),
    ).bind(target, proposers, settings.model_dump(exclude={"deployment_overrides"}))
    log.info("specserve: bundle %s, device %s, modes %s (default %s)", bundle, settings.device,
             ["none", "prompt_lookup", *wanted], settings.default_mode)
    return router
