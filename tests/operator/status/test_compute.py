"""Status computation: kstatus conditions, stable transition times, minimal patches."""

from __future__ import annotations

from typing import Any

import pytest

from davit_operator.api.status import InferenceServiceStatus
from davit_operator.catalog.loader import load_catalog
from davit_operator.planning.errors import PlanError
from davit_operator.planning.placement import NodeFacts
from davit_operator.planning.plan import make_plan
from davit_operator.status.compute import compute_status
from davit_operator.status.patch import status_fields, status_patch
from tests.operator.isvc_helpers import make_spec

CATALOG = load_catalog()
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def _deployment(ready: int, replicas: int = 1, generation: int = 1) -> dict[str, Any]:
    return {
        "metadata": {"generation": generation},
        "status": {
            "observedGeneration": generation,
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": ready,
            "availableReplicas": ready,
        },
    }


def _conds(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def _written(status: InferenceServiceStatus) -> dict[str, Any]:
    """The status as the API server holds it after the patch (the next reconcile's input)."""
    return status_fields(status)


def test_progress_to_ready_and_no_patch_when_unchanged() -> None:
    plan = make_plan("svc", "ns", make_spec(), CATALOG)
    first = _written(
        compute_status(plan=plan, error=None, deployment=None, old_status={}, generation=1, now=T0)
    )
    conds = _conds(first)
    assert conds["Ready"]["status"] == "False" and conds["Reconciling"]["status"] == "True"
    assert conds["Stalled"]["status"] == "False"
    assert conds["ImageResolved"]["reason"] == "Unpinned"
    assert conds["RunnerSelected"]["message"] == "V2: V2 is the default runner of davit 0.1.0"
    ready = _written(
        compute_status(
            plan=plan, error=None, deployment=_deployment(1), old_status=first, generation=1, now=T1
        )
    )
    conds = _conds(ready)
    assert conds["Ready"]["status"] == "True" and conds["Ready"]["lastTransitionTime"] == T1
    assert conds["ImageResolved"]["lastTransitionTime"] == T0
    assert ready["replicaSummary"] == "1/1" and ready["url"] == "http://svc.ns.svc:8000/v1"
    assert ready["artifact"]["tag"] == "0.1.0-cuda13.0" and ready["runner"]["name"] == "v2"
    again = compute_status(
        plan=plan, error=None, deployment=_deployment(1), old_status=ready, generation=1, now="x"
    )
    assert status_patch(ready, again) == {}


def test_spec_error_stalls_and_keeps_the_running_artifact() -> None:
    plan = make_plan("svc", "ns", make_spec(), CATALOG)
    ready = _written(
        compute_status(
            plan=plan, error=None, deployment=_deployment(1), old_status={}, generation=1, now=T0
        )
    )
    with pytest.raises(PlanError) as err:
        make_plan(
            "svc",
            "ns",
            make_spec(engine={"type": "vllm", "version": "0.33.0", "variant": "cuda12.9"}),
            CATALOG,
        )
    stalled = compute_status(
        plan=None,
        error=err.value,
        deployment=_deployment(1),
        old_status=ready,
        generation=2,
        now=T1,
    )
    conds = _conds(_written(stalled))
    assert conds["Stalled"]["status"] == "True" and conds["Ready"]["status"] == "False"
    assert "last published in 0.32.0" in conds["Stalled"]["message"]
    assert conds["ImageResolved"]["status"] == "False"
    assert stalled.observed_generation == 2
    patch = status_patch(ready, stalled)
    assert set(patch) == {"observedGeneration", "conditions"}


def test_impossible_spec_is_explained() -> None:
    nodes = [
        NodeFacts(
            "gpu-h200-0",
            {"nvidia.com/gpu.product": "NVIDIA-H200"},
            {"cpu": "200", "memory": "2000Gi", "nvidia.com/gpu": "8"},
        )
    ]
    plan = make_plan(
        "svc",
        "ns",
        make_spec(parallelism={"tensor": 16}, engine={"type": "vllm", "version": "0.33.0"}),
        CATALOG,
        nodes,
    )
    status = compute_status(
        plan=plan, error=None, deployment=_deployment(0), old_status={}, generation=1, now=T0
    )
    conds = _conds(_written(status))
    assert conds["Stalled"]["status"] == "True" and conds["Stalled"]["reason"] == "NoNodeFits"
    assert conds["Schedulable"]["status"] == "False"
    assert "largest matching node offers 8" in conds["Ready"]["message"]


def test_rollout_in_progress_reconciles() -> None:
    plan = make_plan("svc", "ns", make_spec(replicas=2), CATALOG)
    dep = _deployment(1, replicas=2)
    dep["status"]["updatedReplicas"] = 1
    conds = _conds(
        _written(
            compute_status(
                plan=plan, error=None, deployment=dep, old_status={}, generation=1, now=T0
            )
        )
    )
    assert (
        conds["Reconciling"]["status"] == "True" and conds["Reconciling"]["reason"] == "RollingOut"
    )


def test_engine_names_the_release_the_spec_describes() -> None:
    """status.engine (the ENGINE printer column) is the spec's engine and release, also when
    engine.image overrides the image with a tag that says something else."""
    for engine, expected in (
        ({"type": "vllm", "version": "0.33.0"}, "vllm 0.33.0"),
        (
            {"type": "vllm", "version": "0.33.0", "image": "registry.example/vllm:nightly"},
            "vllm 0.33.0",
        ),
        (
            {"type": "davit", "version": "0.1.0", "image": "registry.example/davit:dev"},
            "davit 0.1.0",
        ),
    ):
        plan = make_plan("svc", "ns", make_spec(engine=engine), CATALOG)
        status = _written(
            compute_status(
                plan=plan, error=None, deployment=None, old_status={}, generation=1, now=T0
            )
        )
        assert status["engine"] == expected, engine


def test_an_override_of_an_unpublished_variant_is_served_with_a_warning() -> None:
    """engine.image bypasses the catalog's address, not its facts: the pods run the override,
    and the status says the release it describes never published that variant."""
    spec = make_spec(
        engine={
            "type": "vllm",
            "version": "0.33.0",
            "variant": "cuda12.9",
            "image": "registry.example/vllm-openai:cu129-build",
        }
    )
    plan = make_plan("svc", "ns", spec, CATALOG)
    status = _written(
        compute_status(
            plan=plan, error=None, deployment=_deployment(1), old_status={}, generation=1, now=T0
        )
    )
    conds = _conds(status)
    warning = conds["Uncatalogued"]
    assert (warning["status"], warning["reason"]) == ("True", "VariantNotPublished")
    assert "vllm 0.33.0 never published the cuda12.9 variant" in warning["message"]
    assert "last published in 0.32.0" in warning["message"]
    assert "registry.example/vllm-openai:cu129-build" in warning["message"]
    assert conds["Ready"]["status"] == "True"  # it serves; the warning says on what
    assert status["engine"] == "vllm 0.33.0"
    assert status["artifact"]["source"] == "override"
    published = make_spec(
        engine={"type": "vllm", "version": "0.33.0", "image": "registry.example/vllm:x"}
    )
    conds = _conds(
        _written(
            compute_status(
                plan=make_plan("svc", "ns", published, CATALOG),
                error=None,
                deployment=_deployment(1),
                old_status={},
                generation=1,
                now=T0,
            )
        )
    )
    assert "Uncatalogued" not in conds
