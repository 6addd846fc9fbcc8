"""Prometheus metrics of the operator process (served on --metrics-port)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

REGISTRY = CollectorRegistry(auto_describe=True)

RECONCILE_TOTAL = Counter(
    "davit_operator_reconcile_total",
    "Reconciles of InferenceService objects, by trigger and result.",
    ["trigger", "result"],
    registry=REGISTRY,
)
RECONCILE_ERRORS = Counter(
    "davit_operator_reconcile_errors_total",
    "Reconciles that failed, by kind of failure (spec, api, unexpected).",
    ["kind"],
    registry=REGISTRY,
)
RECONCILE_DURATION = Histogram(
    "davit_operator_reconcile_duration_seconds",
    "Wall time of one reconcile, by trigger.",
    ["trigger"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    registry=REGISTRY,
)
CHILD_WRITES = Counter(
    "davit_operator_child_writes_total",
    "Server-side applies and deletes of child objects, by kind and action.",
    ["kind", "action"],
    registry=REGISTRY,
)
STATUS_WRITES = Counter(
    "davit_operator_status_writes_total",
    "Status patches of InferenceService objects (unchanged statuses are not written).",
    registry=REGISTRY,
)


def serve_metrics(port: int, address: str = "0.0.0.0") -> None:
    """Expose /metrics on `port` in a background thread."""
    start_http_server(port, addr=address, registry=REGISTRY)
