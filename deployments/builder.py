"""Builds the specserve application (Ray Serve LLM's builder pattern): the deployment
classes are plain Python and each declares its own Serve options
(``get_deployment_options``); this function layers them and binds the graph.

Options, lowest precedence first: ``DEFAULT_OPTIONS`` here, then the class's
``get_deployment_options(settings)``, then ``deployment_overrides`` (programmatic runs);
``serve run serve_config.yaml`` (or ``serve deploy``) calls ``build_app(args)``, and the
config file's ``deployments:`` section overrides all three.
"""
from __future__ import annotations

import logging

from ray import serve
from ray.serve import Application

from specserve.engine.assembly import model_modes
from specserve.engine.model.bundle import Bundle
from specserve.engine.sched.sequence_driver import resolve_default_mode, served_modes

from .proposer import ProposerModel
from .router import RouterIngress
from .settings import ServeSettings
from .target import TargetModel

log = logging.getLogger("specserve.builder")

DEFAULT_OPTIONS = {"num_replicas": 1}  # generic; everything specific is the deployment class's


def deployment_options(settings: ServeSettings, declared: dict) -> dict:
    """Generic defaults, then the class's declared options, then ``deployment_overrides``."""
    name = declared["name"]
    override = settings.deployment_overrides.get(name, {})
    merged = {**DEFAULT_OPTIONS, **declared, **override}
    if "autoscaling_config" in merged:
        merged.pop("num_replicas", None)  # Serve takes one or the other
    return merged


def deployed_modes(settings: ServeSettings, bundle: Bundle) -> list[str]:
    """The model-based proposer modes to deploy: ``engine.speculative.load``, or every one
    the bundle provides; a requested mode the bundle lacks is an error."""
    return model_modes(bundle, settings.engine, f"the bundle at {bundle.directory}")


def default_mode(settings: ServeSettings, wanted: list[str]) -> str:
    """The default mode the router will resolve (the scheduler's own rule: "auto", the
    sliding-window refusal), worked out now so a default that cannot be served fails the
    deploy instead of the router's first request. Raises ``ModelLoadError``."""
    return resolve_default_mode(settings.engine, served_modes(wanted))


def build_app(args: dict | None = None) -> Application:
    settings = ServeSettings.model_validate(args or {})
    bundle = Bundle.load(settings.bundle_dir())
    wanted = deployed_modes(settings, bundle)
    default = default_mode(settings, wanted)
    settings = settings.model_copy(update={"model_dir": str(bundle.directory)})
    engine_config = settings.engine.model_dump(mode="json")

    target = serve.deployment(TargetModel).options(
        **deployment_options(settings, TargetModel.get_deployment_options(settings)),
    ).bind(str(bundle.target_dir), engine_config)
    proposers = {
        mode: serve.deployment(ProposerModel).options(
            **deployment_options(settings, ProposerModel.get_deployment_options(settings, mode)),
        ).bind(str(bundle.directory), mode, engine_config)
        for mode in wanted}
    router = serve.deployment(RouterIngress).options(
        **deployment_options(settings, RouterIngress.get_deployment_options(settings)),
    ).bind(target, proposers, settings.model_dump(mode="json", exclude={"deployment_overrides"}))
    log.info("specserve: bundle %s, device %s, deployed proposers %s (default mode %s)", bundle.directory,
             settings.engine.device, wanted, default)
    return router
