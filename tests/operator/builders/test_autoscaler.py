"""The HorizontalPodAutoscaler builder: target, bounds, metrics per signal, stabilization."""

from __future__ import annotations

import pytest

from davit_operator.api.autoscaling import AutoscalingSpec
from davit_operator.builders.autoscaler import autoscaler_metrics, horizontal_pod_autoscaler
from davit_operator.builders.metadata import Owner
from davit_operator.catalog.loader import load_catalog
from davit_operator.planning.plan import make_plan
from tests.operator.isvc_helpers import make_spec

CATALOG = load_catalog()
OWNER = Owner(name="svc", uid="uid-1")


def _hpa(**fields: object) -> dict[str, object]:
    plan = make_plan("svc", "ns", make_spec(), CATALOG)
    autoscaling = AutoscalingSpec.model_validate({"maxReplicas": 4, **fields})
    return horizontal_pod_autoscaler(plan, OWNER, autoscaling)


def test_targets_the_inference_service_scale_subresource() -> None:
    hpa = _hpa(minReplicas=2, scaleDownStabilizationSeconds=120)
    assert hpa["apiVersion"] == "autoscaling/v2"
    meta = hpa["metadata"]
    assert isinstance(meta, dict)
    assert meta["name"] == "svc" and meta["namespace"] == "ns"
    assert meta["ownerReferences"][0]["uid"] == "uid-1"
    assert meta["ownerReferences"][0]["controller"] is True
    spec = hpa["spec"]
    assert isinstance(spec, dict)
    assert spec["scaleTargetRef"] == {
        "apiVersion": "serving.davit.dev/v1alpha1",
        "kind": "InferenceService",
        "name": "svc",
    }
    assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 4)
    assert spec["behavior"] == {"scaleDown": {"stabilizationWindowSeconds": 120}}


@pytest.mark.parametrize(
    ("signal", "names"),
    [
        ("WaitingRequests", [("vllm_num_requests_waiting", "3")]),
        ("KVCacheUsage", [("vllm_kv_cache_usage_perc", "750m")]),
        (
            "Both",
            [("vllm_num_requests_waiting", "3"), ("vllm_kv_cache_usage_perc", "750m")],
        ),
    ],
)
def test_pods_metrics_per_signal(signal: str, names: list[tuple[str, str]]) -> None:
    autoscaling = AutoscalingSpec.model_validate(
        {
            "maxReplicas": 3,
            "signal": signal,
            "targetWaitingRequests": 3,
            "targetKvCacheUsagePercent": 75,
        }
    )
    metrics = autoscaler_metrics(autoscaling)
    assert all(m["type"] == "Pods" for m in metrics)
    assert [
        (m["pods"]["metric"]["name"], m["pods"]["target"]["averageValue"]) for m in metrics
    ] == names
    assert all(m["pods"]["target"]["type"] == "AverageValue" for m in metrics)


def test_defaults() -> None:
    autoscaling = AutoscalingSpec.model_validate({"maxReplicas": 5})
    assert autoscaling.min_replicas == 1
    assert autoscaling.signal == "WaitingRequests"
    assert autoscaling.scale_down_stabilization_seconds == 300
    assert autoscaler_metrics(autoscaling) == [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "vllm_num_requests_waiting"},
                "target": {"type": "AverageValue", "averageValue": "2"},
            },
        }
    ]


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"minReplicas": 5, "maxReplicas": 2}, "minReplicas must not exceed"),
        ({"minReplicas": 0, "maxReplicas": 2}, "minReplicas"),
        ({"maxReplicas": 2, "targetWaitingRequests": 0}, "targetWaitingRequests"),
        ({"maxReplicas": 2, "targetKvCacheUsagePercent": 101}, "targetKvCacheUsagePercent"),
        ({"maxReplicas": 2, "signal": "Latency"}, "signal"),
    ],
)
def test_bad_specs_name_the_field(fields: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        AutoscalingSpec.model_validate(fields)


def test_clamp() -> None:
    autoscaling = AutoscalingSpec.model_validate({"minReplicas": 2, "maxReplicas": 4})
    assert [autoscaling.clamp(n) for n in (0, 2, 3, 9)] == [2, 2, 3, 4]
