"""Step three of a reconcile: the status, and an event for every change of state.

The status is computed whole every time (typed, `status.compute` and `rollout.status`), and only
the top-level fields whose value changed go into kopf's patch, so an idle reconcile writes
nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf

from davit_operator.api.status import READY, STALLED, Condition, InferenceServiceStatus
from davit_operator.metrics import STATUS_WRITES
from davit_operator.reconcile.apply import Outcome
from davit_operator.reconcile.plan import Subject
from davit_operator.reconcile.replicas import selector_string
from davit_operator.reconcile.runtime import EventPoster
from davit_operator.rollout.status import rollout_status
from davit_operator.status.compute import compute_status
from davit_operator.status.model import with_model
from davit_operator.status.patch import status_patch
from davit_operator.status.scaling import ROUTED, with_scaling


def desired_status(subject: Subject, outcome: Outcome, now: str) -> InferenceServiceStatus:
    """The status this reconcile owns, computed from what it planned and observed."""
    planned = outcome.planned
    if planned.plan is None and planned.error is None:
        # A new model revision is being fetched while the replicas of the last one serve: the
        # status keeps describing them; the model's conditions say what happens next.
        status = InferenceServiceStatus(
            observed_generation=subject.generation,
            conditions=[
                Condition.model_validate(c) for c in subject.status.get("conditions") or []
            ],
        )
    else:
        status = compute_status(
            plan=planned.plan,
            error=planned.error,
            deployment=outcome.deployment,
            old_status=subject.status,
            generation=subject.generation,
            now=now,
        )
    if planned.plan is not None and planned.rollout is not None:
        status = rollout_status(
            planned.rollout.decision, status, subject.status, now, subject.generation
        )
    if planned.delivery is not None:
        model = subject.spec.get("model") or {}
        status = with_model(
            status,
            planned.delivery,
            str(model.get("source", "")),
            model.get("revision"),
            has_replicas=outcome.deployment is not None,
            written=subject.status,
            now=now,
            generation=subject.generation,
        )
    return with_scaling(
        status,
        selector=selector_string(subject.name),
        replicas=outcome.replicas,
        routing=planned.routing if planned.plan is not None else None,
        written=subject.status,
        generation=subject.generation,
        now=now,
    )


def post_state_events(
    post: EventPoster, body: kopf.Body, old: Mapping[str, Any], new: InferenceServiceStatus
) -> None:
    """One event per state change: Ready's status or reason, Stalled's status, Routed's
    status or reason (a Warning while the routing CRDs are missing)."""
    before = {c.get("type"): c for c in old.get("conditions") or []}
    after = {c.type: c for c in new.conditions}
    routed, prior_routed = after.get(ROUTED), before.get(ROUTED)
    if routed and (
        not prior_routed
        or (prior_routed.get("status"), prior_routed.get("reason"))
        != (routed.status, routed.reason)
    ):
        post(
            body, "Normal" if routed.status == "True" else "Warning", routed.reason, routed.message
        )
    ready, stalled = after.get(READY), after.get(STALLED)
    prior_ready, prior_stalled = before.get(READY), before.get(STALLED)
    if stalled and stalled.status == "True":
        if (
            not prior_stalled
            or prior_stalled.get("status") != "True"
            or (prior_stalled.get("reason") != stalled.reason)
        ):
            post(body, "Warning", stalled.reason, stalled.message)
        return
    if prior_stalled and prior_stalled.get("status") == "True":
        post(body, "Normal", "Recovered", "no longer stalled")
    if ready and (
        not prior_ready
        or (prior_ready.get("status"), prior_ready.get("reason")) != (ready.status, ready.reason)
    ):
        post(body, "Normal", ready.reason, f"Ready={ready.status}: {ready.message}")


def report(
    post: EventPoster,
    body: kopf.Body,
    patch: kopf.Patch,
    subject: Subject,
    outcome: Outcome,
    now: str,
) -> None:
    """Put the changed status fields into `patch` and post the events of the change."""
    new = desired_status(subject, outcome, now)
    changes = status_patch(subject.status, new)
    if not changes:
        return
    for key, value in changes.items():
        patch.status[key] = value
    STATUS_WRITES.inc()
    post_state_events(post, body, subject.status, new)
