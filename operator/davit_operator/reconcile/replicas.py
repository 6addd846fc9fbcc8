"""How many replicas an InferenceService runs, and what `status.replicas`/`selector` say.

Without `spec.autoscaling`, `spec.replicas` is the count. With it, `spec.replicas` is where the
service starts, and afterwards only writes through the scale subresource move the count: the
HPA's (and `kubectl scale`'s). A write of the whole object that sets `spec.replicas` (a GitOps
tool or `kubectl apply` re-applying a manifest that still says `replicas: 1`) leaves the count
at the one the operator runs, recorded in `status.desiredReplicas`, so a re-apply never fights
the autoscaler. The object's managedFields say who set `spec.replicas` last: the API server
records a write through the scale subresource with `subresource: scale`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from davit_operator.api.autoscaling import AutoscalingSpec
from davit_operator.builders.metadata import selector_labels


def _owns_replicas(fields: Any) -> bool:
    spec = fields.get("f:spec") if isinstance(fields, Mapping) else None
    return isinstance(spec, Mapping) and "f:replicas" in spec


def scaled_through_subresource(managed_fields: Iterable[Mapping[str, Any]]) -> bool:
    """Whether `spec.replicas` is owned by a write through the scale subresource (the HPA's
    or `kubectl scale`), rather than by a write of the whole object."""
    owners = [m for m in managed_fields if _owns_replicas(m.get("fieldsV1"))]
    return any(m.get("subresource") == "scale" for m in owners)


def effective_replicas(
    replicas: int,
    autoscaling: AutoscalingSpec | None,
    managed_fields: Iterable[Mapping[str, Any]],
    recorded: int | None,
) -> int:
    """The replica count to run: `replicas` (spec.replicas) without autoscaling; with it, the
    count last set through the scale subresource, else the one recorded in status
    (`recorded`), else `replicas` (the starting point), always within [min, max]."""
    if autoscaling is None:
        return replicas
    if recorded is None or scaled_through_subresource(managed_fields):
        return autoscaling.clamp(replicas)
    return autoscaling.clamp(recorded)


def selector_string(name: str) -> str:
    """`status.selector`: the label selector of every engine pod of the service (both rollout
    tracks), in the string form the scale subresource serves to the HPA."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def observed_replicas(deployments: Iterable[Mapping[str, Any]]) -> int:
    """`status.replicas`: the engine pods of every track's Deployment."""
    return sum(int((d.get("status") or {}).get("replicas") or 0) for d in deployments)
