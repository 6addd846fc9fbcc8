"""The rollout's part of the status: `status.rollout`, the revision history and the
RolloutProgressing condition, with kstatus conditions that follow the rollout."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from davit_operator.api.rollout import ROLLOUT_PROGRESSING, RevisionRecord, RolloutStatus
from davit_operator.api.status import READY, RECONCILING, STALLED, InferenceServiceStatus
from davit_operator.rollout.machine import Decision
from davit_operator.status.conditions import ConditionState, set_conditions


def rollout_status(
    decision: Decision,
    status: InferenceServiceStatus,
    written: Mapping[str, Any],
    now: str,
    generation: int,
) -> InferenceServiceStatus:
    """`status` with the decision's rollout, revision history and RolloutProgressing condition;
    a rolled-back or failed target stalls, a progressing one reconciles. `written` is the
    object's status as last written (for the conditions' transition times)."""
    condition_status, reason, message = decision.condition
    states = [ConditionState(ROLLOUT_PROGRESSING, condition_status, reason, message)]
    stalled = any(c.type == STALLED and c.status == "True" for c in status.conditions)
    if decision.failed and not stalled:
        states += [
            ConditionState(READY, "False", decision.failed, message),
            ConditionState(RECONCILING, "False", decision.failed, "waiting for the spec to change"),
            ConditionState(STALLED, "True", decision.failed, message),
        ]
    elif not decision.settled and not stalled and decision.rollout.get("phase") != "Complete":
        states.append(ConditionState(RECONCILING, "True", reason, message))
    conditions = set_conditions(
        status.conditions,
        states,
        written=written.get("conditions") or [],
        generation=generation,
        now=now,
    )
    return status.model_copy(
        update={
            # Unset rollout fields stay None: kopf's merge patch deletes a field only when it
            # is sent as null.
            "rollout": RolloutStatus.model_validate(decision.rollout),
            "revisions": [RevisionRecord.model_validate(r) for r in decision.revisions],
            "conditions": conditions,
        }
    )
