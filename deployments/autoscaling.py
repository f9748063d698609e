"""Autoscaling on what each replica really serves, not on the requests Serve routes.

The router calls target and proposer workers directly every round, so Serve's own
policy (ongoing requests counted at its handles) would see next to nothing and keep a
deployment at its minimum. Instead each target and proposer replica reports its own
load through Serve's ``record_autoscaling_stats`` hook -- the sequences in its worker's
batches and, for a target, the KV blocks reserved in its pool -- and
``ReplicaLoadPolicy``, set as the deployment's ``autoscaling_config.policy``, sizes the
deployment from the sum over its replicas (``AutoscalingContext.aggregated_metrics``).
Serve still applies ``min_replicas`` / ``max_replicas``, the up- and downscale delays
and the scaling factors around the policy's answer.

A deployment that autoscales on Serve's default policy instead keeps its rounds on
Serve's request path (``workers.calls_go_direct``), slower but sized right.

Serve pickles this module by value into its controller, so it imports nothing of
specserve's.
"""
from __future__ import annotations

from typing import Any

# What replicas report (``record_autoscaling_stats``), by name.
SEQUENCES = "sequences"            # sequences whose state the replica's worker holds
KV_BLOCKS_USED = "kv_blocks_used"  # target only: blocks reserved in its pool (admission's limit)
KV_BLOCKS_TOTAL = "kv_blocks_total"

POLICY_PATH = "specserve.deployments.autoscaling:ReplicaLoadPolicy"


class ReplicaLoadPolicy:
    """Replicas wanted = the deployment's load over what one replica should carry:
    ``target_sequences`` sequences each, and, where ``target_kv_fraction`` is set, that
    share of a replica's KV blocks reserved -- whichever asks for more. Serve makes one
    instance per deployment (``policy_kwargs`` are its arguments) and calls it every
    control-loop tick."""

    def __init__(self, target_sequences: float = 16.0, target_kv_fraction: float | None = None) -> None:
        if target_sequences <= 0 or (target_kv_fraction is not None and not 0 < target_kv_fraction <= 1):
            raise ValueError("target_sequences must be > 0 and target_kv_fraction in (0, 1]")
        self.target_sequences, self.target_kv_fraction = target_sequences, target_kv_fraction

    def __call__(self, ctx: Any) -> tuple[float, dict]:
        metrics = ctx.aggregated_metrics or {}
        sequences = metrics.get(SEQUENCES) or {}
        if not sequences:  # no replica has reported yet (starting up): keep what Serve wants now
            return ctx.target_num_replicas, {}
        return replicas_for_load(sum(sequences.values()), self.target_sequences,
                                 sum((metrics.get(KV_BLOCKS_USED) or {}).values()),
                                 list((metrics.get(KV_BLOCKS_TOTAL) or {}).values()), self.target_kv_fraction), {}


def replicas_for_load(sequences: float, target_sequences: float, kv_used: float = 0.0,
                      kv_totals: list[float] | None = None, target_kv_fraction: float | None = None) -> float:
    """The replicas a load needs (a fraction: Serve rounds it up after its scaling factors)."""
    wanted = sequences / target_sequences
    if target_kv_fraction and kv_totals:
        per_replica = sum(kv_totals) / len(kv_totals)
        if per_replica > 0:
            wanted = max(wanted, kv_used / (target_kv_fraction * per_replica))
    return wanted


def reads_replica_load(policy: Any) -> bool:
    """Whether an ``AutoscalingPolicy`` is this module's (its function is named by an
    import path, ``module:attr`` or ``module.attr``, or is the class itself)."""
    function = getattr(policy, "policy_function", None)
    if isinstance(function, str):
        return function.replace(":", ".") == POLICY_PATH.replace(":", ".")
    return function is ReplicaLoadPolicy


def replica_load_autoscaling(min_replicas: int = 1, max_replicas: int = 2, target_sequences: float = 16.0,
                             target_kv_fraction: float | None = None, **knobs) -> dict:
    """An ``autoscaling_config`` (as a config file or ``deployment_overrides`` writes it)
    that sizes a deployment on its replicas' own load; ``knobs`` are Serve's other fields
    (``upscale_delay_s``, ``look_back_period_s``, ...)."""
    kwargs: dict = {"target_sequences": target_sequences}
    if target_kv_fraction is not None:
        kwargs["target_kv_fraction"] = target_kv_fraction
    return {"min_replicas": min_replicas, "max_replicas": max_replicas, **knobs,
            "policy": {"policy_function": POLICY_PATH, "policy_kwargs": kwargs}}

