"""Condition transitions: the only code that decides a condition's lastTransitionTime.

A condition keeps the transition time it was last written with while its status stays the same,
so computing the status twice from the same observations yields the same conditions and the
operator writes nothing. Reason and message may change without a transition.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from davit_operator.api.status import (
    IMAGE_RESOLVED,
    MEMORY_PLANNED,
    MODEL_READY,
    READY,
    RECONCILING,
    RUNNER_SELECTED,
    SCHEDULABLE,
    STALLED,
    UNCATALOGUED,
    Condition,
    ConditionStatus,
)

# The order conditions are listed in; conditions of other types (rollout) follow.
CONDITION_ORDER = (
    READY,
    RECONCILING,
    STALLED,
    IMAGE_RESOLVED,
    UNCATALOGUED,
    RUNNER_SELECTED,
    SCHEDULABLE,
    MODEL_READY,
    MEMORY_PLANNED,
)


@dataclass(frozen=True)
class ConditionState:
    """A condition as one observation decides it, before its transition time is known."""

    type: str
    status: ConditionStatus
    reason: str
    message: str = ""


def in_order(states: Iterable[ConditionState]) -> list[ConditionState]:
    """`states` sorted by `CONDITION_ORDER` (every type must be in it)."""
    return sorted(states, key=lambda s: CONDITION_ORDER.index(s.type))


def set_conditions(
    conditions: Sequence[Condition],
    states: Iterable[ConditionState],
    *,
    written: Sequence[Mapping[str, Any]],
    generation: int,
    now: str,
) -> list[Condition]:
    """`conditions` with each of `states` set: a condition of the same type is replaced where it
    stands, a new type is appended. `written` is the conditions list of the status as it was
    last written (the object's, not one computed in this reconcile): a state keeps that
    condition's lastTransitionTime while the status is unchanged, and gets `now` otherwise."""
    before = {c.get("type"): c for c in written}
    out = {c.type: c for c in conditions}
    for state in states:
        previous = before.get(state.type)
        since = previous.get("lastTransitionTime") if previous is not None else None
        if previous is None or previous.get("status") != state.status or not since:
            since = now
        out[state.type] = Condition(
            type=state.type,
            status=state.status,
            reason=state.reason,
            message=state.message,
            last_transition_time=str(since),
            observed_generation=generation,
        )
    return list(out.values())
