"""Why the application cannot serve yet, said at once.

The router answers ``/health``, ``/v1/models`` and the generation routes within
``READY_WAIT_S`` whatever its deployments are doing: while the target is pending (a
replica waiting for resources the cluster lacks, a model still loading) or has no live
replica (being replaced), with a 503 that names the deployment and why, read from
Serve's own status (``serve.status()``) and from the replicas' pending placement groups
(what they ask for, against what the cluster has) -- in a thread, so a slow controller
never holds the router's loop -- and cached briefly, since every request of a burst
would ask.
"""
from __future__ import annotations

import asyncio
import logging
import time

from specserve.engine.sched.background import detached

log = logging.getLogger("specserve.readiness")

READY_WAIT_S = 0.5     # how long a request waits for the router's first connection before asking why
CONNECT_WAIT_S = 30.0  # how long it waits on when Serve says every deployment is healthy (a handle's
                       # first call is still finding the replicas): then no 503 is due
STATUS_TIMEOUT_S = 0.3  # how long a 503 waits for Serve's status to say why
STATUS_CACHE_S = 1.0


def not_ready_reason(app_status, waiting: dict[str, list[dict]] | None = None,
                     cluster_total: dict | None = None) -> str:
    """Each deployment that is not healthy, its replicas' states and Serve's message, and
    for one whose replicas wait for resources (``waiting``: deployment -> the bundles of a
    replica's pending placement group) what they ask for that the cluster does not have
    (``cluster_total``). Empty when every deployment is healthy."""
    parts = []
    for name, deployment in sorted(app_status.deployments.items()):
        status = str(getattr(deployment.status, "value", deployment.status))
        if status == "HEALTHY":
            continue
        states = {str(getattr(s, "value", s)): n for s, n in (deployment.replica_states or {}).items() if n}
        replicas = ", ".join(f"{n} {state.lower().replace('_', ' ')}" for state, n in sorted(states.items()))
        text = f"deployment {name} is {status.lower()}" + (f" (replicas: {replicas})" if replicas else "")
        bundles = (waiting or {}).get(name)
        if bundles is not None:
            text += f"; a replica waits for resources {bundles}"
            lacking = _lacking(bundles, cluster_total or {})
            if lacking:
                text += f", more than the cluster has ({lacking})"
        if deployment.message:
            text += f": {deployment.message}"
        parts.append(text)
    return "; ".join(parts)


def _lacking(bundles: list[dict], total: dict) -> str:
    """What a replica's bundles ask for beyond the whole cluster's resources."""
    wanted: dict[str, float] = {}
    for bundle in bundles:
        for resource, amount in bundle.items():
            wanted[resource] = wanted.get(resource, 0.0) + amount
    return ", ".join(f"{resource} {amount:g} asked, {total.get(resource, 0):g} in the cluster"
                     for resource, amount in sorted(wanted.items()) if amount > total.get(resource, 0.0))


def waiting_replicas(placement_groups: dict, app_name: str) -> dict[str, list[dict]]:
    """Deployment -> the bundles of one of its replicas' placement groups still pending
    (Serve names a replica's group after the replica: ``...{app}#{deployment}#{id}``)."""
    out: dict[str, list[dict]] = {}
    for group in placement_groups.values():
        parts = str(group.get("name", "")).rsplit("#", 2)
        if group.get("state") == "PENDING" and len(parts) == 3 and parts[0].endswith(app_name):
            bundles = group.get("bundles") or {}
            out.setdefault(parts[1], [dict(bundles[i]) for i in sorted(bundles)])
    return out


class Readiness:
    """Serve's view of this application, fetched when a 503 needs a reason."""

    def __init__(self, app_name: str) -> None:
        self.app_name = app_name
        self._reason: tuple[float, str] | None = None
        self._fetching: asyncio.Future | None = None

    def known(self) -> str | None:
        """The reason fetched within ``STATUS_CACHE_S``, if any (empty: all healthy then)."""
        if self._reason is not None and time.monotonic() - self._reason[0] < STATUS_CACHE_S:
            return self._reason[1]
        return None

    async def reason(self) -> str:
        """Why the application is not ready; empty when Serve says every deployment is healthy."""
        now = time.monotonic()
        if self._reason is not None and now - self._reason[0] < STATUS_CACHE_S:
            return self._reason[1]
        if self._fetching is None or self._fetching.done():
            self._fetching = detached(asyncio.to_thread(self._fetch))
        try:
            reason = await asyncio.wait_for(asyncio.shield(self._fetching), STATUS_TIMEOUT_S)
        except asyncio.TimeoutError:
            return "its deployments are not ready (Serve's status did not answer in time)"
        except Exception as exc:  # noqa: BLE001 - a status we cannot read must not turn a 503 into a 500
            log.debug("serve status unavailable: %r", exc)
            return "its deployments are not ready"
        self._reason = (time.monotonic(), reason)
        return reason

    def _fetch(self) -> str:
        import ray
        from ray import serve
        from ray.util.placement_group import placement_group_table

        app = serve.status().applications.get(self.app_name)
        if app is None:
            return f"application {self.app_name} is not deployed"
        return not_ready_reason(app, waiting_replicas(placement_group_table(), self.app_name), ray.cluster_resources())
