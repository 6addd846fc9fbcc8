"""Wires the rollout machine into a reconcile: observe, read the canary, decide, build.

`plan_rollout` turns the live Deployments (from the watch cache) and, when a canary runs and its
analysis is due, a reading of the canary engines' metrics into a `Decision`, and builds the
Deployments that decision wants (`builders.deployment`): the stable track from the stable
revision's spec, the canary track from the spec's revision. `apply_rollout_effects` carries out
what a plain apply cannot: deleting a canary no longer wanted and weighting an HTTPRoute.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from davit_operator.api.spec import InferenceServiceSpec
from davit_operator.builders.children import children
from davit_operator.builders.deployment import (
    EngineDeployment,
    canary_name,
    engine_deployment,
    pod_template,
)
from davit_operator.builders.metadata import Owner
from davit_operator.kube import KubeClient, KubeError
from davit_operator.metrics import CHILD_WRITES
from davit_operator.planning.errors import PlanError
from davit_operator.planning.plan import Plan
from davit_operator.rollout.gateway import GATEWAY_VERSION, weighted_rules
from davit_operator.rollout.machine import (
    Decision,
    Inputs,
    Target,
    canary_split,
    decide,
    parse_iso,
)
from davit_operator.rollout.observe import observe, read_canary

logger = logging.getLogger(__name__)

# How long the rollout status this process wrote stands in for a watch event not yet seen.
RECENT_STATUS_SECONDS = 30.0
GATEWAY_CHECK_SECONDS = 60.0


@dataclass(frozen=True)
class WrittenRollout:
    """The rollout status one reconcile wrote, and when (time.monotonic)."""

    rollout: dict[str, Any]
    revisions: list[dict[str, Any]]
    at: float


@dataclass(frozen=True)
class GatewayCheck:
    """Whether the API server served HTTPRoutes, and when that was asked (time.monotonic)."""

    served: bool
    at: float


@dataclass
class RolloutMemory:
    """Per-object memory across reconciles (part of the object's memo): the rollout status this
    process wrote last, which a reconcile that runs before the watch shows it must not undo."""

    written: WrittenRollout | None = None
    gateway: GatewayCheck | None = None


@dataclass(frozen=True)
class RolloutResult:
    decision: Decision
    deployments: list[EngineDeployment]  # desired Deployments (stable first)
    remove_canary: dict[str, Any] | None  # the live canary Deployment to delete
    route: tuple[str, str, int, int] | None = None  # (route, service, port, canary weight)

    def children(
        self, plan: Plan, owner: Owner, served: Collection[str] = ()
    ) -> list[dict[str, Any]]:
        """Every child to apply: the rollout's Deployments, then the plan's other children
        (with a Service per track while an HTTPRoute splits the traffic); `served` names the
        optional routing kinds the API server serves."""
        deployments = [d.manifest for d in self.deployments]
        return children(
            plan, owner, deployments, per_track_services=self.route is not None, served=served
        )


async def apply_rollout_effects(
    kube: KubeClient, namespace: str, result: RolloutResult
) -> list[str]:
    """Delete the canary Deployment the decision no longer wants (by uid: a new canary of the
    same name is left alone) and set the HTTPRoute's weights; returns what was written."""
    writes = []
    live = result.remove_canary
    if live is not None:
        meta = live["metadata"]
        await kube.delete("Deployment", meta["namespace"], meta["name"], meta["uid"])
        CHILD_WRITES.labels(kind="Deployment", action="delete").inc()
        writes.append(f"deleted Deployment {meta['name']}")
    if result.route is not None:
        route, service, port, weight = result.route
        current = await kube.get("HTTPRoute", namespace, route)
        if current is not None:
            rules = list((current.get("spec") or {}).get("rules") or [])
            wanted = weighted_rules(rules, service, port, weight)
            if wanted != rules:
                await kube.merge_patch("HTTPRoute", namespace, route, {"spec": {"rules": wanted}})
                CHILD_WRITES.labels(kind="HTTPRoute", action="patch").inc()
                writes.append(f"set HTTPRoute {route} weights {100 - weight}/{weight}")
    return writes


async def _gateway_served(kube: KubeClient, memory: RolloutMemory) -> bool:
    """Whether HTTPRoutes are served, checked at most once a minute."""
    now = time.monotonic()
    if memory.gateway is None or now - memory.gateway.at > GATEWAY_CHECK_SECONDS:
        memory.gateway = GatewayCheck(await kube.serves(GATEWAY_VERSION, "httproutes"), now)
    return memory.gateway.served


def _target(plan: Plan, revision: str) -> Target:
    return Target(
        revision=revision,
        spec_json=plan.spec.model_dump_json(by_alias=True, exclude_none=True),
        image=plan.image.reference,
        digest=plan.image.digest,
        engine_args=(*plan.invocation.command, *plan.invocation.args),
    )


async def plan_rollout(
    *,
    kube: KubeClient,
    plan: Plan,
    owner: Owner,
    make_stable_plan: Callable[[InferenceServiceSpec], Plan],
    status: dict[str, Any],
    live: dict[str, dict[str, Any]],
    memory: RolloutMemory,
    now: float | None = None,
) -> RolloutResult:
    """Decide the rollout for this reconcile and build the Deployments it wants."""
    now = time.time() if now is None else now
    old = dict(status.get("rollout") or {})
    revisions = list(status.get("revisions") or [])
    written = memory.written
    if (
        written is not None
        and old != written.rollout
        and time.monotonic() - written.at < RECENT_STATUS_SECONDS
    ):
        old, revisions = dict(written.rollout), list(written.revisions)
    template = pod_template(plan)
    target = _target(plan, template.revision)
    stable_live = live.get(plan.name)
    canary_live = live.get(canary_name(plan.name))
    spec = plan.spec.rollout
    # Observe with the replica count the previous decision gave the stable side.
    previous_stable = plan.replicas
    if old.get("phase") in ("Progressing", "Paused") and old.get("strategy") == "Canary":
        previous_stable = canary_split(plan.replicas, int(old.get("weight") or 0))[1]
    observed = observe(stable_live, canary_live, previous_stable)
    reading = None
    if observed.canary_revision == target.revision and observed.canary_ready > 0:
        last = parse_iso((old.get("analysis") or {}).get("at"))
        if last is None or now - last >= spec.analysis.interval_seconds:
            try:
                reading = await read_canary(kube, plan, target.revision)
            except KubeError as exc:
                # No reading this time (for example pods not readable yet): the step is not
                # judged, and its deadline still runs.
                logger.warning("rollout %s: cannot list the canary pods: %s", plan.name, exc)
                reading = None
            if reading is not None and reading.pods_read == 0:
                reading = None
    decision = decide(
        Inputs(
            spec=spec,
            replicas=plan.replicas,
            target=target,
            old=old,
            revisions=revisions,
            observed=observed,
            reading=reading,
            now=now,
        )
    )
    route_name = spec.canary.http_route if spec.canary is not None else None
    on_route = route_name is not None and await _gateway_served(kube, memory)
    rollout = dict(decision.rollout)
    rollout["routing"] = f"HTTPRoute/{route_name}" if on_route else "ReplicaRatio"
    decision = replace(decision, rollout=rollout)
    if on_route and decision.canary_replicas > 0:
        # The route splits the traffic: the stable side keeps every replica.
        decision = replace(decision, stable_replicas=max(decision.stable_replicas, plan.replicas))
    memory.written = WrittenRollout(decision.rollout, decision.revisions, time.monotonic())
    if decision.stable_spec_json == target.spec_json:
        stable_plan = plan
    else:
        try:
            stable_plan = make_stable_plan(
                InferenceServiceSpec.model_validate_json(decision.stable_spec_json)
            )
        except (ValidationError, PlanError):
            # The stable spec no longer plans (an operator upgrade changed the catalog):
            # only the spec's revision can be built.
            stable_plan = plan
    deployments = [
        engine_deployment(
            stable_plan,
            owner,
            "stable",
            decision.stable_replicas,
            paused=decision.stable_paused,
            track_labels=route_name is not None,
            template=template if stable_plan is plan else None,
        )
    ]
    remove = None
    if decision.canary_replicas > 0:
        deployments.append(
            engine_deployment(plan, owner, "canary", decision.canary_replicas, template=template)
        )
    elif canary_live is not None:
        remove = canary_live
    route = None
    if on_route and route_name is not None:
        weight = int(decision.rollout.get("weight") or 0) if decision.canary_replicas else 0
        route = (route_name, plan.name, plan.port, weight)
    return RolloutResult(
        decision=decision, deployments=deployments, remove_canary=remove, route=route
    )
