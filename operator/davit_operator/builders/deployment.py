"""The engine Deployment: one builder for both tracks of a rollout.

The stable track is the Deployment `NAME` (selector `inferenceservice=NAME`); the canary track is
`NAME-canary`, selected also by `track=canary`. Both sit behind the same Service, whose selector
matches both, so the replica ratio is the traffic ratio. A Deployment's revision is the hash of
its engine pod template before any track label is added, so the same plan has the same
revision on either track and at any replica count.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

from davit_operator.api.identity import GROUP
from davit_operator.builders.digest import template_revision
from davit_operator.builders.metadata import (
    Owner,
    common_labels,
    object_metadata,
    selector_labels,
)
from davit_operator.builders.pod import (
    engine_volume_mounts,
    engine_volumes,
    scheduling,
    serving_env,
)
from davit_operator.planning.plan import Plan

Track = Literal["stable", "canary"]
TRACKS: tuple[Track, ...] = ("stable", "canary")

REVISION_ANNOTATION = f"{GROUP}/revision"
REVISION_LABEL = f"{GROUP}/revision"
TRACK_LABEL = f"{GROUP}/track"
CANARY_SUFFIX = "-canary"
STARTUP_FAILURE_THRESHOLD = 180  # x 10 s: half an hour to download and load large weights
PRESTOP_SLEEP_SECONDS = 5  # longer than endpoint propagation, short against a drain
EXIT_MARGIN_SECONDS = 10  # engine shutdown after the drain (core process, sockets)


def canary_name(name: str) -> str:
    return f"{name}{CANARY_SUFFIX}"


def termination_grace_seconds(drain_seconds: int) -> int:
    """Grace period covering the pre-stop delay, the engine's drain and its exit."""
    return PRESTOP_SLEEP_SECONDS + drain_seconds + EXIT_MARGIN_SECONDS


def _probe(path: str, period: int, failure_threshold: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failure_threshold,
    }


def _container(plan: Plan) -> dict[str, Any]:
    return {
        "name": "engine",
        "image": plan.image.reference,
        "command": plan.invocation.command,
        "args": plan.invocation.args,
        "env": serving_env(plan),
        "ports": [{"name": "http", "containerPort": plan.port, "protocol": "TCP"}],
        "resources": plan.placement.resources,
        "readinessProbe": _probe(plan.health.readiness, 5, 3),
        "livenessProbe": _probe(plan.health.liveness, 10, 6),
        "startupProbe": _probe(plan.health.liveness, 10, STARTUP_FAILURE_THRESHOLD),
        "volumeMounts": engine_volume_mounts(plan),
        # Let endpoints drop the pod before SIGTERM starts the engine's drain.
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}},
    }


@dataclass(frozen=True)
class PodTemplate:
    """The engine pod template of one plan and its revision. Build it once per plan and pass it
    to `engine_deployment` when the revision was needed before the replica count was known."""

    template: dict[str, Any]
    revision: str


def pod_template(plan: Plan) -> PodTemplate:
    pod_spec: dict[str, Any] = {
        "containers": [_container(plan)],
        "volumes": engine_volumes(plan),
        # Engines drain in-flight requests on SIGTERM: pre-stop delay + drain + exit margin.
        "terminationGracePeriodSeconds": termination_grace_seconds(plan.spec.rollout.drain_seconds),
        **scheduling(plan),
    }
    template = {"metadata": {"labels": common_labels(plan)}, "spec": pod_spec}
    return PodTemplate(template=template, revision=template_revision(template))


@dataclass(frozen=True)
class EngineDeployment:
    """A desired engine Deployment and the revision its pods run."""

    manifest: dict[str, Any]
    revision: str


def engine_deployment(
    plan: Plan,
    owner: Owner,
    track: Track,
    replicas: int,
    *,
    paused: bool = False,
    track_labels: bool = False,
    template: PodTemplate | None = None,
) -> EngineDeployment:
    """The Deployment of `plan` on `track` with `replicas` replicas.

    `paused` pauses the Deployment controller (a paused rolling update). `track_labels` marks the
    stable track's pods `track=stable` for the per-track Services of an HTTPRoute (canary pods
    always carry `track=canary`). `template` is `pod_template(plan)` when the caller has it.
    """
    built = template if template is not None else pod_template(plan)
    revision = built.revision
    pod = copy.deepcopy(built.template)
    metadata = object_metadata(plan, owner)
    metadata["annotations"] = {REVISION_ANNOTATION: revision}
    selector = selector_labels(plan.name)
    if track == "canary":
        metadata["name"] = canary_name(plan.name)
        metadata["labels"] = {**metadata["labels"], TRACK_LABEL: "canary"}
        selector = {**selector, TRACK_LABEL: "canary"}
        pod["metadata"]["labels"].update({TRACK_LABEL: "canary", REVISION_LABEL: revision})
    elif track_labels:
        pod["metadata"]["labels"][TRACK_LABEL] = "stable"
    spec: dict[str, Any] = {
        "replicas": replicas,
        "selector": {"matchLabels": selector},
        # Accelerators are scarce: by default no extra replica starts during a rollout.
        "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {
                "maxSurge": plan.spec.rollout.rolling.max_surge,
                "maxUnavailable": plan.spec.rollout.rolling.max_unavailable,
            },
        },
        "progressDeadlineSeconds": plan.spec.rollout.progress_deadline_seconds,
        "template": pod,
    }
    if paused:
        spec["paused"] = True
    manifest = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata, "spec": spec}
    return EngineDeployment(manifest=manifest, revision=revision)
