"""Step one of a reconcile: what the InferenceService wants.

The spec is parsed and planned (with the model's shape and, for our engine, its measured
memory profile), then the rollout decides which Deployments run which revision with how many
replicas. Nothing here applies a child; the profiling Job and the rollout's reads are the only
requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import kopf
from pydantic import ValidationError

from davit_operator.api.spec import InferenceServiceSpec
from davit_operator.builders.metadata import Owner
from davit_operator.kube import KubeError
from davit_operator.planning.errors import PlanError
from davit_operator.planning.plan import Plan, default_shapes, make_plan
from davit_operator.profiling import needs_profile, replicas_may_start, resolve_profile
from davit_operator.reconcile.indexes import Indexes, KubeObject, ObjectKey
from davit_operator.reconcile.memo import ObjectMemo
from davit_operator.reconcile.runtime import Runtime
from davit_operator.rollout.controller import RolloutResult, plan_rollout


@dataclass(frozen=True)
class Subject:
    """The InferenceService one reconcile is about."""

    name: str
    namespace: str
    uid: str
    generation: int
    spec: dict[str, Any]
    status: dict[str, Any]  # as last written

    @classmethod
    def of(cls, body: kopf.Body) -> Subject:
        meta = body.metadata
        return cls(
            name=meta["name"],
            namespace=meta["namespace"],
            uid=meta["uid"],
            generation=int(meta.get("generation", 0)),
            spec=dict(body.spec),
            status=dict(body.status),
        )

    @property
    def key(self) -> ObjectKey:
        return (self.namespace, self.name)

    @property
    def owner(self) -> Owner:
        return Owner(name=self.name, uid=self.uid)


@dataclass(frozen=True)
class Planned:
    """What the object wants. `error` says why the spec cannot (fully) be served; `rollout` is
    None without a plan and while the replicas wait for their memory profile. `plan` and
    `error` can both be set: a profile that failed after the plan was made."""

    plan: Plan | None
    error: PlanError | None = None
    rollout: RolloutResult | None = None

    def desired_children(self, owner: Owner) -> list[KubeObject]:
        """The children to apply (none without a rollout decision)."""
        if self.plan is None or self.rollout is None:
            return []
        return self.rollout.children(self.plan, owner)


def spec_error(exc: ValidationError) -> PlanError:
    """A spec the models refuse although the CRD schema admitted it."""
    first = exc.errors()[0]
    field = ".".join(str(part) for part in first["loc"])
    return PlanError(
        field=field,
        value=first.get("input"),
        reason="InvalidSpec",
        condition="",
        message=f"spec.{field}: {first['msg']} (the CRD schema should have refused this; "
        "is the installed CRD older than the operator?)",
    )


def child_rejected(exc: KubeError) -> PlanError:
    """The API server refused a child built from this spec: the user must act."""
    return PlanError(
        field="spec", value=None, reason="ChildRejected", condition="", message=exc.message
    )


async def _plan_spec(
    runtime: Runtime, body: kopf.Body, subject: Subject, indexes: Indexes
) -> tuple[Plan | None, PlanError | None]:
    plan: Plan | None = None
    try:
        spec = InferenceServiceSpec.model_validate(subject.spec)
        shapes = (
            await runtime.model_configs.shapes_for(spec, default_shapes())
            if runtime.model_configs is not None
            else None
        )
        plan = make_plan(
            subject.name, subject.namespace, spec, runtime.catalog, indexes.node_list(), shapes
        )
        if runtime.profile_memory and needs_profile(plan):
            profiled = await resolve_profile(runtime.kube, plan, subject.owner, runtime.profiles)
            plan = profiled.plan
            if profiled.action:
                runtime.post_event(body, "Normal", "MemoryProfile", profiled.action)
    except ValidationError as exc:
        return plan, spec_error(exc)
    except PlanError as exc:
        return plan, exc
    return plan, None


async def plan_object(
    runtime: Runtime, body: kopf.Body, subject: Subject, indexes: Indexes, memo: ObjectMemo
) -> Planned:
    """Plan the spec and, once replicas may start, decide the rollout. Raises KubeError only
    for errors worth retrying; a refusal becomes the `error` of a Planned without a plan."""
    plan, error = await _plan_spec(runtime, body, subject, indexes)
    # While the profiling Job runs, no replica starts: they all get its KV size.
    if plan is None or not replicas_may_start(plan):
        return Planned(plan, error)
    nodes = indexes.node_list()
    try:
        rollout = await plan_rollout(
            kube=runtime.kube,
            plan=plan,
            owner=subject.owner,
            # The stable revision keeps the KV bytes its replicas were started with.
            make_stable_plan=lambda s: runtime.profiles.apply(
                make_plan(subject.name, subject.namespace, s, runtime.catalog, nodes)
            ),
            status=subject.status,
            live=indexes.deployments_by_name(subject.key),
            memory=memo.rollout,
        )
    except KubeError as exc:
        if exc.is_temporary:
            raise
        return Planned(None, child_rejected(exc))
    return Planned(plan, error, rollout)
