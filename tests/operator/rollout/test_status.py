"""The rollout's status: its conditions follow the decision and keep their transition times."""

from __future__ import annotations

from davit_operator.api.status import InferenceServiceStatus
from davit_operator.rollout.machine import Decision
from davit_operator.rollout.status import rollout_status
from davit_operator.status.patch import status_fields


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
