"""Step one of a reconcile: what the InferenceService wants.

The spec is parsed and planned (with the model's shape and, for our engine, its measured
memory profile), then the rollout decides which Deployments run which revision with how many
replicas. Nothing here applies a child; the profiling Job and the rollout's reads are the only
requests.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import kopf
from pydantic import ValidationError

from davit_operator.api.spec import InferenceServiceSpec
from davit_operator.builders.metadata import Owner
from davit_operator.builders.routing import HTTP_ROUTE_VERSION, INFERENCE_POOL_VERSION
from davit_operator.delivery import Delivery, resolve_delivery
from davit_operator.kube import KubeError
from davit_operator.planning.errors import PlanError
from davit_operator.planning.plan import Plan, default_shapes, make_plan
from davit_operator.profiling import needs_profile, replicas_may_start, resolve_profile
from davit_operator.reconcile.indexes import Indexes, KubeObject, ObjectKey
from davit_operator.reconcile.memo import ObjectMemo
from davit_operator.reconcile.replicas import effective_replicas
from davit_operator.reconcile.runtime import EMPTY_DIR_CACHE, Runtime
from davit_operator.rollout.controller import RolloutResult, plan_rollout
from davit_operator.status.scaling import Routing


@dataclass(frozen=True)
class Subject:
    """The InferenceService one reconcile is about."""

    name: str
    namespace: str
    uid: str
    generation: int
    spec: dict[str, Any]
    status: dict[str, Any]  # as last written
    # metadata.managedFields: who wrote spec.replicas last (reconcile.replicas)
    managed_fields: tuple[dict[str, Any], ...] = ()

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
            managed_fields=tuple(dict(m) for m in meta.get("managedFields") or ()),
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
    delivery: Delivery | None = None
    routing: Routing | None = None  # spec.routing's InferencePool, when it asks for one

    def desired_children(self, owner: Owner) -> list[KubeObject]:
        """The children to apply (none without a rollout decision)."""
        if self.plan is None or self.rollout is None:
            return []
        served = []
        if self.routing is not None and self.routing.pool_served:
            served.append("InferencePool")
        if self.routing is not None and self.routing.route_served:
            served.append("HTTPRoute")
        return self.rollout.children(self.plan, owner, served)


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


def with_model_cache(spec: InferenceServiceSpec, default: str | None) -> InferenceServiceSpec:
    """`spec` with the operator's default model cache (a claim name, or EMPTY_DIR_CACHE to opt
    out for every service) where the spec names none. Raises PlanError when an hf:// or s3://
    model has no cache to go to."""
    model = spec.model
    scheme = model.source.partition("://")[0]
    if scheme not in ("hf", "s3"):
        return spec
    cache = model.cache
    if cache.claim_name is None and not cache.empty_dir and default is not None:
        if default == EMPTY_DIR_CACHE:
            cache = cache.model_copy(update={"empty_dir": True})
        else:
            cache = cache.model_copy(update={"claim_name": default})
    if cache.empty_dir and scheme == "s3":
        raise PlanError(
            field="model.cache.emptyDir",
            value=True,
            reason="ModelCacheRequired",
            condition="",
            message="model.source s3:// is fetched only into the model cache (no engine reads "
            "S3 itself); set model.cache.claimName to a ReadWriteMany PersistentVolumeClaim",
        )
    if cache.claim_name is None and not cache.empty_dir:
        raise PlanError(
            field="model.cache.claimName",
            value=None,
            reason="ModelCacheRequired",
            condition="",
            message=f"model.source {model.source} is fetched once into a model cache, and none "
            "is configured: set model.cache.claimName to a ReadWriteMany PersistentVolumeClaim "
            "in this namespace (or start the operator with --model-cache CLAIM), or opt out "
            "with model.cache.emptyDir: true (each pod then fetches the model itself)",
        )
    if cache == model.cache:
        return spec
    return spec.model_copy(update={"model": model.model_copy(update={"cache": cache})})


def fetch_failed(delivery: Delivery) -> PlanError:
    """A fetch that failed for good: the user must fix the spec, the Secret or the source."""
    field = {
        "Unauthorized": "model.credentialsSecret",
        "RevisionNotFound": "model.revision",
        "DiskFull": "model.cache.claimName",
    }.get(delivery.reason or "", "model.source")
    return PlanError(
        field=field,
        value=None,
        reason=delivery.reason or "FetchFailed",
        condition="",
        message=delivery.message,
    )


async def _plan_spec(
    runtime: Runtime, body: kopf.Body, subject: Subject, indexes: Indexes
) -> tuple[Plan | None, PlanError | None, Delivery | None]:
    plan: Plan | None = None
    delivery: Delivery | None = None
    try:
        spec = with_model_cache(
            InferenceServiceSpec.model_validate(subject.spec), runtime.model_cache
        )
        shapes = (
            await runtime.model_configs.shapes_for(spec, default_shapes())
            if runtime.model_configs is not None
            else None
        )
        plan = make_plan(
            subject.name, subject.namespace, spec, runtime.catalog, indexes.node_list(), shapes
        )
        replicas = effective_replicas(
            spec.replicas,
            spec.autoscaling,
            subject.managed_fields,
            subject.status.get("desiredReplicas"),
        )
        plan = replace(plan, replicas=replicas)
        # The model comes first: profiling and replicas both need it in the cache.
        delivery = await resolve_delivery(runtime.kube, plan, subject.owner, runtime.fetch)
        if delivery.action:
            runtime.post_event(body, "Normal", "ModelFetch", delivery.action)
        if delivery.state == "Failed":
            return plan, fetch_failed(delivery), delivery
        if not delivery.replicas_may_start:
            return plan, None, delivery
        if runtime.profile_memory and needs_profile(plan):
            profiled = await resolve_profile(runtime.kube, plan, subject.owner, runtime.profiles)
            plan = profiled.plan
            if profiled.action:
                runtime.post_event(body, "Normal", "MemoryProfile", profiled.action)
    except ValidationError as exc:
        return plan, spec_error(exc), delivery
    except PlanError as exc:
        return plan, exc, delivery
    return plan, None, delivery


async def plan_routing(runtime: Runtime, plan: Plan) -> Routing | None:
    """What spec.routing asks for, and which of those kinds the API server serves."""
    pool = plan.spec.routing.inference_pool
    if pool is None:
        return None
    route = pool.http_route
    return Routing(
        name=plan.name,
        picker=f"{pool.endpoint_picker_ref.name}:{pool.endpoint_picker_ref.port}",
        gateway=route.parent_ref.name if route is not None else None,
        pool_served=await runtime.serves(INFERENCE_POOL_VERSION, "inferencepools"),
        route_served=route is not None and await runtime.serves(HTTP_ROUTE_VERSION, "httproutes"),
    )


async def plan_object(
    runtime: Runtime, body: kopf.Body, subject: Subject, indexes: Indexes, memo: ObjectMemo
) -> Planned:
    """Plan the spec and, once replicas may start, decide the rollout. Raises KubeError only
    for errors worth retrying; a refusal becomes the `error` of a Planned without a plan."""
    plan, error, delivery = await _plan_spec(runtime, body, subject, indexes)
    if delivery is not None and not delivery.replicas_may_start:
        # The model is not in the cache yet (or cannot get there): nothing changes for the
        # replicas, so a running revision keeps serving. While replicas of an earlier spec
        # run, the status keeps describing them (no plan); the conditions say what happens.
        running = indexes.named("Deployment", subject.key, subject.name) is not None
        keep = None if (running or error is not None) else plan
        return Planned(keep, error, delivery=delivery)
    # While the profiling Job runs, no replica starts: they all get its KV size.
    if plan is None or not replicas_may_start(plan):
        return Planned(plan, error, delivery=delivery)
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
        routing = await plan_routing(runtime, plan)
    except KubeError as exc:
        if exc.is_temporary:
            raise
        return Planned(None, child_rejected(exc), delivery=delivery)
    return Planned(plan, error, rollout, delivery, routing)
