"""Rollout children and status: the canary and stable Deployments, drain settings, conditions."""

from __future__ import annotations

from isvc_helpers import make_spec

from davit_operator.api.status import InferenceServiceStatus
from davit_operator.builders.deployment import (
    REVISION_ANNOTATION,
    TRACK_LABEL,
    engine_deployment,
    pod_template,
)
from davit_operator.builders.metadata import Owner
from davit_operator.catalog.loader import load_catalog
from davit_operator.planning.plan import make_plan
from davit_operator.rollout.machine import Decision
from davit_operator.rollout.status import rollout_status
from davit_operator.status.patch import status_fields

CATALOG = load_catalog()
OWNER = Owner(name="svc", uid="u-1")
INSTANCE = "serving.davit.dev/inferenceservice"


def test_canary_deployment_sits_inside_the_service_selector_with_its_own() -> None:
    plan = make_plan("svc", "ns", make_spec(replicas=4, limits={"maxNumSeqs": 8}), CATALOG)
    built = engine_deployment(plan, OWNER, "canary", 1)
    canary = built.manifest
    revision = pod_template(plan).revision
    assert built.revision == revision
    assert canary["metadata"]["name"] == "svc-canary"
    assert canary["spec"]["replicas"] == 1
    assert canary["spec"]["selector"]["matchLabels"] == {INSTANCE: "svc", TRACK_LABEL: "canary"}
    labels = canary["spec"]["template"]["metadata"]["labels"]
    assert labels[INSTANCE] == "svc" and labels[TRACK_LABEL] == "canary"
    assert labels["serving.davit.dev/revision"] == revision
    assert canary["metadata"]["annotations"] == {REVISION_ANNOTATION: revision}
    # Same engine as the stable Deployment would run for this plan.
    stable_built = engine_deployment(plan, OWNER, "stable", 3)
    stable = stable_built.manifest
    assert stable_built.revision == revision
    assert stable["metadata"]["annotations"] == {REVISION_ANNOTATION: revision}
    assert (
        canary["spec"]["template"]["spec"]["containers"]
        == stable["spec"]["template"]["spec"]["containers"]
    )
    assert stable["spec"]["selector"]["matchLabels"] == {INSTANCE: "svc"}
    assert TRACK_LABEL not in stable["spec"]["template"]["metadata"]["labels"]
    marked = engine_deployment(plan, OWNER, "stable", 3, paused=True, track_labels=True).manifest
    assert marked["spec"]["paused"] is True
    assert marked["spec"]["template"]["metadata"]["labels"][TRACK_LABEL] == "stable"


def test_revision_ignores_replicas_and_follows_the_engine() -> None:
    a = make_plan("svc", "ns", make_spec(replicas=1), CATALOG)
    b = make_plan("svc", "ns", make_spec(replicas=5), CATALOG)
    c = make_plan("svc", "ns", make_spec(replicas=1, limits={"maxModelLen": 4096}), CATALOG)
    assert pod_template(a).revision == pod_template(b).revision
    assert pod_template(a).revision != pod_template(c).revision
    # A track or a replica count is no new revision either.
    on_canary = engine_deployment(b, OWNER, "canary", 2).revision
    assert engine_deployment(a, OWNER, "stable", 1).revision == on_canary


def test_drain_settings_match_the_engine_flag() -> None:
    plan = make_plan("svc", "ns", make_spec(rollout={"drainSeconds": 45}), CATALOG)
    built = engine_deployment(plan, OWNER, "stable", 1).manifest
    pod = built["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    assert pod["terminationGracePeriodSeconds"] == 5 + 45 + 10
    args = container["args"]
    assert args[args.index("--drain-timeout") + 1] == "45"
    strategy = built["spec"]["strategy"]["rollingUpdate"]
    assert strategy == {"maxSurge": 0, "maxUnavailable": 1}


def _decision(condition: tuple[str, str, str], failed: str | None, settled: bool) -> Decision:
    return Decision(
        stable_spec_json="{}",
        stable_replicas=1,
        stable_paused=False,
        canary_replicas=0,
        rollout={
            "phase": "RolledBack" if failed else "Progressing",
            "strategy": "Canary",
            "step": None,
        },
        revisions=[],
        condition=condition,
        failed=failed,
        settled=settled,
    )


def test_rollback_stalls_and_keeps_transition_times() -> None:
    written = {
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "ReplicasReady", "message": "",
             "lastTransitionTime": "T0", "observedGeneration": 3},
            {"type": "Stalled", "status": "False", "reason": "ReplicasReady", "message": "",
             "lastTransitionTime": "T0", "observedGeneration": 3},
        ]
    }  # fmt: skip
    computed = InferenceServiceStatus.model_validate(written)
    decision = _decision(("False", "RolledBack", "revision b AnalysisFailed"), "RolledBack", True)
    first = status_fields(rollout_status(decision, computed, written, "T1", 3))
    by_type = {c["type"]: c for c in first["conditions"]}
    assert (by_type["Stalled"]["status"], by_type["Stalled"]["reason"]) == ("True", "RolledBack")
    assert by_type["Ready"]["status"] == "False" and by_type["Ready"]["lastTransitionTime"] == "T1"
    assert by_type["RolloutProgressing"]["message"] == "revision b AnalysisFailed"
    assert first["rollout"]["step"] is None, "None is sent, so the merge patch removes it"
    # Recomputed later from the same observation: no transition, no new time.
    again = status_fields(rollout_status(decision, computed, first, "T2", 3))
    assert again["conditions"] == first["conditions"]
