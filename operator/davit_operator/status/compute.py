"""Status computation (pure): plan or refusal + observed Deployment -> the status to write.

The result is an `InferenceServiceStatus` whose set fields are exactly the fields this
computation owns: with a plan, every summary field (None where unknown, which deletes it); with
a refusal, only `observedGeneration` and the conditions, so the status keeps describing what the
replicas still run while the conditions say why nothing changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from davit_operator.api.status import (
    IMAGE_RESOLVED,
    MEMORY_PLANNED,
    READY,
    RECONCILING,
    RUNNER_SELECTED,
    SCHEDULABLE,
    STALLED,
    UNCATALOGUED,
    ArtifactStatus,
    InferenceServiceStatus,
    RunnerStatus,
)
from davit_operator.planning.errors import PlanError
from davit_operator.planning.plan import Plan
from davit_operator.status.conditions import ConditionState, in_order, set_conditions
from davit_operator.status.progress import deployment_progress


def conditions_for(
    plan: Plan | None, error: PlanError | None, deployment: dict[str, Any] | None
) -> list[ConditionState]:
    """The full set of conditions for one observation."""
    if error is not None:
        conds = [
            ConditionState(READY, "False", error.reason, error.message),
            ConditionState(RECONCILING, "False", error.reason, "waiting for the spec to change"),
            ConditionState(STALLED, "True", error.reason, error.message),
        ]
        if error.condition == IMAGE_RESOLVED:
            conds.append(ConditionState(IMAGE_RESOLVED, "False", error.reason, error.message))
        elif error.condition == RUNNER_SELECTED:
            conds.append(ConditionState(IMAGE_RESOLVED, "True", "Resolved", "the image resolved"))
            conds.append(ConditionState(RUNNER_SELECTED, "False", error.reason, error.message))
        return conds
    assert plan is not None
    image = plan.image
    conds = [
        ConditionState(
            IMAGE_RESOLVED,
            "True",
            "Pinned" if image.pinned else "Unpinned",
            f"{image.reference} ({image.engine_type} {image.engine_version}, {image.variant}, "
            f"from {image.source}{', no digest recorded' if not image.pinned else ''})",
        ),
        ConditionState(
            RUNNER_SELECTED,
            "True",
            "Fallback" if plan.runner.is_fallback else "Selected",
            f"{plan.runner.name.upper()}: {plan.runner.reason}",
        ),
    ]
    if image.assumed_release is not None:
        conds.append(
            ConditionState(
                UNCATALOGUED,
                "True",
                "NewerThanCatalog",
                f"{image.engine_type} {image.engine_version} is not in catalog "
                f"{image.catalog_version} (the newest {image.engine_type} release there is "
                f"{image.assumed_release}); it runs engine.image {image.reference} with the "
                f"runner rules, arguments and limits of {image.assumed_release}, which are "
                f"assumed, not verified against {image.engine_version}'s artifact",
            )
        )
    if image.unpublished is not None:
        conds.append(
            ConditionState(
                UNCATALOGUED,
                "True",
                "VariantNotPublished",
                f"catalog {image.catalog_version}: {image.engine_type} {image.unpublished}; "
                f"engine.image {image.reference} runs in its place with the runner rules, "
                f"arguments and limits of {image.engine_type} {image.engine_version}, which are "
                "assumed, not verified against that image",
            )
        )
    if plan.fit.fits is False:
        conds.append(ConditionState(SCHEDULABLE, "False", "NoNodeFits", plan.fit.message))
        return [
            ConditionState(READY, "False", "NoNodeFits", plan.fit.message),
            ConditionState(
                RECONCILING, "False", "NoNodeFits", "waiting for the spec or the nodes to change"
            ),
            ConditionState(STALLED, "True", "NoNodeFits", plan.fit.message),
            *conds,
        ]
    if plan.fit.fits is True:
        conds.append(ConditionState(SCHEDULABLE, "True", "NodeFits", plan.fit.message))
    if plan.memory is not None:
        profiling = plan.memory.source == "pending"
        conds.append(
            ConditionState(
                MEMORY_PLANNED,
                "False" if profiling else "True",
                "Profiling" if profiling else plan.memory.source.capitalize(),
                plan.memory.message,
            )
        )
    done, reason, message = deployment_progress(deployment, plan.replicas)
    if plan.memory is not None and plan.memory.source == "pending" and deployment is None:
        # Replicas wait for the profile; say so instead of "does not exist yet".
        reason, message = "ProfilingMemory", plan.memory.message
    if done:
        head = [
            ConditionState(READY, "True", reason, message),
            ConditionState(RECONCILING, "False", reason, ""),
            ConditionState(STALLED, "False", reason, ""),
        ]
    elif reason == "ProgressDeadlineExceeded":
        head = [
            ConditionState(READY, "False", reason, message),
            ConditionState(RECONCILING, "False", reason, ""),
            ConditionState(STALLED, "True", reason, message),
        ]
    else:
        head = [
            ConditionState(READY, "False", reason, message),
            ConditionState(RECONCILING, "True", reason, message),
            ConditionState(STALLED, "False", reason, ""),
        ]
    return head + conds


def compute_status(
    *,
    plan: Plan | None,
    error: PlanError | None,
    deployment: dict[str, Any] | None,
    old_status: Mapping[str, Any],
    generation: int,
    now: str,
) -> InferenceServiceStatus:
    """The status owned by this computation (see the module docstring); `old_status` is the
    object's status as last written, for the conditions' transition times."""
    conditions = set_conditions(
        [],
        in_order(conditions_for(plan, error, deployment)),
        written=old_status.get("conditions") or [],
        generation=generation,
        now=now,
    )
    if plan is None:
        return InferenceServiceStatus(observed_generation=generation, conditions=conditions)
    image = plan.image
    observed = (deployment or {}).get("status") or {}
    ready = int(observed.get("readyReplicas", 0))
    return InferenceServiceStatus(
        observed_generation=generation,
        conditions=conditions,
        artifact=ArtifactStatus(
            image=image.reference,
            repository=image.repository,
            tag=image.tag,
            digest=image.digest,
            pinned=image.pinned,
            engine_type=image.engine_type,
            engine_version=image.engine_version,
            release_title=image.release_title,
            variant=image.variant,
            catalog_version=image.catalog_version,
            source=image.source,
        ),
        runner=RunnerStatus(name=plan.runner.name, reason=plan.runner.reason),
        memory_plan=plan.memory.to_status() if plan.memory is not None else None,
        # The release the spec describes, not the image tag (an override's tag is anything).
        engine=f"{image.engine_type} {image.engine_version}",
        accelerator=plan.placement.summary,
        engine_args=[*plan.invocation.command, *plan.invocation.args],
        desired_replicas=plan.replicas,
        ready_replicas=ready,
        updated_replicas=int(observed.get("updatedReplicas", 0)),
        replica_summary=f"{ready}/{plan.replicas}",
        url=plan.service_url,
    )
