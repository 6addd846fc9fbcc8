"""`spec.autoscaling`: a HorizontalPodAutoscaler on the InferenceService's scale subresource.

The operator creates and owns the autoscaler (`autoscaling/v2`, built into every cluster: no
add-on to install besides the metrics pipeline). It scales on the engines' own load signals,
served to the HPA as Pods metrics through `custom.metrics.k8s.io` (for example Prometheus
scraping the engines plus prometheus-adapter): the waiting requests per replica
(`vllm:num_requests_waiting`) and the KV-cache usage (`vllm:kv_cache_usage_perc`, a fraction).
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from davit_operator.api.schema import CrdModel, cel_rule

AutoscalingSignal = Literal["WaitingRequests", "KVCacheUsage", "Both"]

# The Pods metric names the HPA asks `custom.metrics.k8s.io` for: the engines' series with the
# `vllm:` prefix renamed (metric API names are path segments; docs/autoscaling.md has the
# prometheus-adapter rules that serve them).
WAITING_REQUESTS_METRIC = "vllm_num_requests_waiting"
KV_CACHE_USAGE_METRIC = "vllm_kv_cache_usage_perc"


class AutoscalingSpec(CrdModel):
    """Replica bounds, the load signal and its target, and how slowly to scale down."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel_rule(
                    "self.minReplicas <= self.maxReplicas",
                    "autoscaling.minReplicas must not exceed autoscaling.maxReplicas",
                    ".minReplicas",
                )
            ]
        }
    )

    min_replicas: int = Field(
        default=1,
        ge=1,
        le=1000,
        description="Fewest replicas the autoscaler keeps (at least 1: an idle engine answers "
        "the first request without a cold start).",
    )
    max_replicas: int = Field(
        ge=1, le=1000, description="Most replicas the autoscaler starts (also during rollouts)."
    )
    signal: AutoscalingSignal = Field(
        default="WaitingRequests",
        description="Which engine metric drives the replica count: WaitingRequests (average "
        "vllm:num_requests_waiting per replica), KVCacheUsage (average vllm:kv_cache_usage_perc) "
        "or Both (the HPA takes the larger replica count of the two).",
    )
    target_waiting_requests: int = Field(
        default=2,
        ge=1,
        le=100_000,
        description="WaitingRequests: average queued requests per replica to hold. A queued "
        "request waits for a batch slot, so a small queue scales out before latency grows.",
    )
    target_kv_cache_usage_percent: int = Field(
        default=80,
        ge=1,
        le=100,
        description="KVCacheUsage: average KV-cache usage per replica to hold, in percent.",
    )
    scale_down_stabilization_seconds: int = Field(
        default=300,
        ge=0,
        le=3600,
        description="How long the load must stay low before replicas are removed (the HPA's "
        "scale-down stabilization window); removed engines drain their requests first.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError("autoscaling.minReplicas must not exceed autoscaling.maxReplicas")
        return self

    def clamp(self, replicas: int) -> int:
        """`replicas` within [minReplicas, maxReplicas]."""
        return min(max(replicas, self.min_replicas), self.max_replicas)
