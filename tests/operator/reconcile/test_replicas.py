"""Which replica count the operator runs: spec.replicas, or with autoscaling the count last set
through the scale subresource, never reset by a re-apply of the whole object."""

from __future__ import annotations

from typing import Any

from davit_operator.api.autoscaling import AutoscalingSpec
from davit_operator.reconcile.replicas import (
    effective_replicas,
    observed_replicas,
    scaled_through_subresource,
    selector_string,
)

AUTOSCALING = AutoscalingSpec.model_validate({"minReplicas": 1, "maxReplicas": 6})
REPLICAS_FIELD = {"f:spec": {"f:replicas": {}}}


def _entry(manager: str, *, subresource: str | None = None, replicas: bool = True) -> Any:
    entry: dict[str, Any] = {
        "manager": manager,
        "operation": "Update",
        "fieldsV1": REPLICAS_FIELD if replicas else {"f:spec": {"f:model": {}}},
    }
    if subresource:
        entry["subresource"] = subresource
    return entry


APPLIED = [_entry("kubectl-client-side-apply")]
SCALED = [_entry("kubectl-client-side-apply", replicas=False), _entry("hpa", subresource="scale")]


def test_without_autoscaling_spec_replicas_is_the_count() -> None:
    assert effective_replicas(3, None, SCALED, recorded=5) == 3
    assert effective_replicas(0, None, APPLIED, recorded=2) == 0


def test_the_starting_point_is_spec_replicas_within_the_bounds() -> None:
    assert effective_replicas(2, AUTOSCALING, APPLIED, recorded=None) == 2
    assert effective_replicas(9, AUTOSCALING, APPLIED, recorded=None) == 6
    assert effective_replicas(0, AUTOSCALING, APPLIED, recorded=None) == 1


def test_a_scale_write_moves_the_count() -> None:
    assert scaled_through_subresource(SCALED)
    assert effective_replicas(4, AUTOSCALING, SCALED, recorded=2) == 4
    # The autoscaler's range holds even for a count written through the subresource.
    assert effective_replicas(40, AUTOSCALING, SCALED, recorded=2) == 6


def test_a_reapply_of_the_manifest_keeps_the_running_count() -> None:
    # The HPA scaled to 4; a GitOps sync wrote the manifest's replicas: 1 over it.
    assert not scaled_through_subresource(APPLIED)
    assert effective_replicas(1, AUTOSCALING, APPLIED, recorded=4) == 4


def test_narrowed_bounds_still_apply_to_the_recorded_count() -> None:
    narrow = AutoscalingSpec.model_validate({"minReplicas": 1, "maxReplicas": 3})
    assert effective_replicas(1, narrow, APPLIED, recorded=5) == 3


def test_server_side_apply_with_replicas_owned_by_a_manager_and_the_autoscaler() -> None:
    # A value written through the scale subresource that equals an applier's shares the field.
    shared = [
        {"manager": "argocd", "operation": "Apply", "fieldsV1": REPLICAS_FIELD},
        _entry("hpa", subresource="scale"),
    ]
    assert effective_replicas(3, AUTOSCALING, shared, recorded=2) == 3


def test_status_replicas_and_selector() -> None:
    deployments = [{"status": {"replicas": 3}}, {"status": {"replicas": 1}}, {"status": {}}]
    assert observed_replicas(deployments) == 4
    assert selector_string("svc") == "serving.davit.dev/inferenceservice=svc"
