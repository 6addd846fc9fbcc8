"""The HorizontalPodAutoscaler of `spec.autoscaling`.

It targets the InferenceService itself (its scale subresource), not a Deployment: the operator
splits the count it sets between the rollout's tracks, and the HPA reads the pods of both
through the selector in `status.selector`. Its metrics are Pods metrics (the engines' load
averaged over the service's pods), served by `custom.metrics.k8s.io`.
"""

from __future__ import annotations

from typing import Any

from davit_operator.api.autoscaling import (
    KV_CACHE_USAGE_METRIC,
    WAITING_REQUESTS_METRIC,
    AutoscalingSpec,
)
from davit_operator.api.identity import API_VERSION, KIND
from davit_operator.builders.metadata import Owner, object_metadata
from davit_operator.planning.plan import Plan


def _pods_metric(name: str, average: str) -> dict[str, Any]:
    return {
        "type": "Pods",
        "pods": {
            "metric": {"name": name},
            "target": {"type": "AverageValue", "averageValue": average},
        },
    }


def autoscaler_metrics(autoscaling: AutoscalingSpec) -> list[dict[str, Any]]:
    """The HPA's metrics for the spec's signal; with Both the HPA takes the larger count."""
    metrics = []
    if autoscaling.signal in ("WaitingRequests", "Both"):
        metrics.append(
            _pods_metric(WAITING_REQUESTS_METRIC, str(autoscaling.target_waiting_requests))
        )
    if autoscaling.signal in ("KVCacheUsage", "Both"):
        # vllm:kv_cache_usage_perc is a fraction (0..1) despite its name: 80 % is 800m.
        metrics.append(
            _pods_metric(
                KV_CACHE_USAGE_METRIC, f"{autoscaling.target_kv_cache_usage_percent * 10}m"
            )
        )
    return metrics


def horizontal_pod_autoscaler(
    plan: Plan, owner: Owner, autoscaling: AutoscalingSpec
) -> dict[str, Any]:
    """`autoscaling/v2` HPA NAME on the InferenceService NAME's scale subresource."""
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": object_metadata(plan, owner),
        "spec": {
            "scaleTargetRef": {"apiVersion": API_VERSION, "kind": KIND, "name": plan.name},
            "minReplicas": autoscaling.min_replicas,
            "maxReplicas": autoscaling.max_replicas,
            "metrics": autoscaler_metrics(autoscaling),
            "behavior": {
                "scaleDown": {
                    "stabilizationWindowSeconds": autoscaling.scale_down_stabilization_seconds
                }
            },
        },
    }
