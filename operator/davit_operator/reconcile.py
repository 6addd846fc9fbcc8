"""One level-based reconcile of an InferenceService: plan, apply what differs, compute status.

Every kopf trigger calls `reconcile`. It reads live children from kopf indexes (watch caches)
rather than the API server, writes only children that differ from the desired state, and puts
only the status fields that changed into kopf's patch, so an idle reconcile sends no request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf
from pydantic import ValidationError

from davit_operator.api.spec import InferenceServiceSpec
from davit_operator.api.status import InferenceServiceStatus
from davit_operator.builders.children import children
from davit_operator.builders.deployment import engine_deployment
from davit_operator.builders.digest import DESIRED_HASH_ANNOTATION, with_hash
from davit_operator.builders.metadata import Owner
from davit_operator.catalog.loader import Catalog
from davit_operator.kube import KubeClient, KubeError, needs_apply
from davit_operator.metrics import (
    CHILD_WRITES,
    RECONCILE_DURATION,
    RECONCILE_ERRORS,
    RECONCILE_TOTAL,
    STATUS_WRITES,
)
from davit_operator.model_config import ModelConfigSource
from davit_operator.planning.errors import PlanError
from davit_operator.planning.placement import NodeFacts
from davit_operator.planning.plan import Plan, default_shapes, make_plan
from davit_operator.profiling import (
    ProfileCache,
    needs_profile,
    replicas_may_start,
    resolve_profile,
)
from davit_operator.rollout.controller import (
    RolloutMemory,
    RolloutResult,
    apply_rollout_effects,
    plan_rollout,
)
from davit_operator.rollout.status import rollout_status
from davit_operator.status.compute import compute_status
from davit_operator.status.patch import status_patch

# How long an own apply stands in for a watch event that has not arrived yet.
RECENT_APPLY_SECONDS = 60.0


def _kopf_event(body: kopf.Body, type: str, reason: str, message: str) -> None:
    kopf.event(body, type=type, reason=reason, message=message)


@dataclass
class Runtime:
    """Per-process state shared by the handlers through kopf's memo (kopf copies the operator's
    memo into each object's memo, so every handler sees the same Runtime). `post_event` is
    kopf's event poster in the operator and a recorder in tests."""

    catalog: Catalog
    kube: KubeClient
    post_event: Callable[[kopf.Body, str, str, str], None] = _kopf_event
    # Profile engine memory once per identity before replicas start (davit_operator.profiling);
    # the operator's command line turns it on (--memory-profiling, the default there).
    profile_memory: bool = False
    # config.json over HTTP for shapes the catalog lacks (davit_operator.model_config).
    model_configs: ModelConfigSource | None = None
    profiles: ProfileCache = field(default_factory=ProfileCache)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _first(index: kopf.Index[Any, Any], key: Any) -> Any | None:
    store = index.get(key)
    if not store:
        return None
    for value in store:
        return value
    return None


def _spec_error(exc: ValidationError) -> PlanError:
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


def _post_events(
    post: Callable[[kopf.Body, str, str, str], None],
    body: kopf.Body,
    old: dict[str, Any],
    new: InferenceServiceStatus,
) -> None:
    """One event per state change: Ready's status or reason, Stalled's status."""
    before = {c.get("type"): c for c in old.get("conditions") or []}
    after = {c.type: c for c in new.conditions}
    ready, stalled = after.get("Ready"), after.get("Stalled")
    prior_ready, prior_stalled = before.get("Ready"), before.get("Stalled")
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


async def _apply_children(
    runtime: Runtime,
    plan: Plan,
    owner: Owner,
    indexes: dict[str, kopf.Index[Any, Any]],
    recent: dict[str, tuple[str, dict[str, Any], float]],
    desired_children: list[dict[str, Any]] | None = None,
) -> tuple[dict[str, Any] | None, list[str]]:
    """Apply what differs; delete a PodDisruptionBudget no longer wanted. Returns the live
    Deployment (fresh from the apply when one happened, else from the index) and the writes
    made ("applied Deployment", "deleted PodDisruptionBudget").

    `recent` remembers this object's own applies (kind -> hash, response, time) until the watch
    cache shows them: a reconcile that runs before the watch event arrives must not apply again.
    """
    key = (plan.namespace, plan.name)
    live_deployment: dict[str, Any] | None = _named(indexes["deployment"], key, plan.name)
    wanted_kinds = set()
    writes: list[str] = []
    now = time.monotonic()
    if desired_children is None:
        stable = engine_deployment(plan, owner, "stable", plan.replicas).manifest
        desired_children = children(plan, owner, [stable])
    for desired in desired_children:
        kind = desired["kind"]
        child_name = desired["metadata"]["name"]
        # A rollout's canary Deployment shares the owner key with the stable one.
        memo_key = kind if child_name == plan.name else f"{kind}/{child_name}"
        is_main_deployment = kind == "Deployment" and child_name == plan.name
        wanted_kinds.add(kind)
        live = _named(indexes[kind.lower()], key, child_name)
        obj = with_hash(desired)
        wanted_hash = obj["metadata"]["annotations"][DESIRED_HASH_ANNOTATION]
        if memo_key in recent:
            applied_hash, response, at = recent[memo_key]
            if _hash_of(live) == applied_hash or now - at > RECENT_APPLY_SECONDS:
                del recent[memo_key]
            elif applied_hash == wanted_hash:
                live = response
                if is_main_deployment:
                    live_deployment = response
        if not needs_apply(obj, live):
            continue
        applied = await runtime.kube.apply(obj)
        recent[memo_key] = (wanted_hash, applied, now)
        CHILD_WRITES.labels(kind=kind, action="apply").inc()
        writes.append(f"applied {kind}" + ("" if child_name == plan.name else f" {child_name}"))
        if is_main_deployment:
            live_deployment = applied
    stale = _first(indexes["poddisruptionbudget"], key)
    if "PodDisruptionBudget" not in wanted_kinds and stale is not None:
        uid = stale["metadata"]["uid"]
        # A budget deleted moments ago can linger in the watch cache: delete it once.
        marker = f"deleted:{uid}"
        previous = recent.get("PodDisruptionBudget")
        if previous is None or previous[0] != marker or now - previous[2] > RECENT_APPLY_SECONDS:
            await runtime.kube.delete("PodDisruptionBudget", plan.namespace, plan.name, uid)
            recent["PodDisruptionBudget"] = (marker, {}, now)
            CHILD_WRITES.labels(kind="PodDisruptionBudget", action="delete").inc()
            writes.append("deleted PodDisruptionBudget")
    return live_deployment, writes


def _named(index: kopf.Index[Any, Any], key: Any, name: str) -> Any | None:
    """The indexed object under `key` with this metadata.name."""
    for value in index.get(key) or ():
        if value["metadata"]["name"] == name:
            return value
    return None


def _hash_of(obj: dict[str, Any] | None) -> str | None:
    if obj is None:
        return None
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    value = annotations.get(DESIRED_HASH_ANNOTATION)
    return str(value) if value is not None else None


def _nodes(index: kopf.Index[Any, Any]) -> list[NodeFacts]:
    found: list[NodeFacts] = []
    for key in index:
        node = _first(index, key)
        if node is not None:
            found.append(node)
    return sorted(found, key=lambda n: n.name)


async def reconcile(
    *,
    trigger: str,
    runtime: Runtime,
    body: kopf.Body,
    patch: kopf.Patch,
    indexes: dict[str, kopf.Index[Any, Any]],
    retry_delay: float,
    lock: asyncio.Lock,
    recent: dict[str, tuple[str, dict[str, Any], float]],
    rollout_memory: RolloutMemory | None = None,
) -> None:
    """Level-based reconcile of one InferenceService (see module docstring). `lock` serialises
    the triggers of one object (the timer runs beside the event handlers)."""
    started = time.monotonic()
    meta = body.metadata
    name, namespace, uid = meta["name"], meta["namespace"], meta["uid"]
    generation = int(meta.get("generation", 0))
    result = "ok"
    async with lock:
        try:
            plan: Plan | None = None
            error: PlanError | None = None
            try:
                spec = InferenceServiceSpec.model_validate(dict(body.spec))
                shapes = (
                    await runtime.model_configs.shapes_for(spec, default_shapes())
                    if runtime.model_configs is not None
                    else None
                )
                plan = make_plan(
                    name, namespace, spec, runtime.catalog, _nodes(indexes["node"]), shapes
                )
                if runtime.profile_memory and needs_profile(plan):
                    profiled = await resolve_profile(
                        runtime.kube, plan, Owner(name=name, uid=uid), runtime.profiles
                    )
                    plan = profiled.plan
                    if profiled.action:
                        runtime.post_event(body, "Normal", "MemoryProfile", profiled.action)
            except ValidationError as exc:
                error = _spec_error(exc)
            except PlanError as exc:
                error = exc
            deployment = _named(indexes["deployment"], (namespace, name), name)
            rollout: RolloutResult | None = None
            # While the profiling Job runs, no replica starts: they all get its KV size.
            if plan is not None and replicas_may_start(plan):
                try:
                    owner = Owner(name=name, uid=uid)
                    nodes = _nodes(indexes["node"])
                    rollout = await plan_rollout(
                        kube=runtime.kube,
                        plan=plan,
                        owner=owner,
                        # The stable revision keeps the KV bytes its replicas were started with.
                        make_stable_plan=lambda s: runtime.profiles.apply(
                            make_plan(name, namespace, s, runtime.catalog, nodes)
                        ),
                        status=dict(body.status),
                        live={
                            d["metadata"]["name"]: d
                            for d in indexes["deployment"].get((namespace, name)) or ()
                        },
                        memory=rollout_memory if rollout_memory is not None else RolloutMemory(),
                    )
                    effects = await apply_rollout_effects(runtime.kube, namespace, rollout)
                    if effects:
                        runtime.post_event(body, "Normal", "Applied", ", ".join(effects))
                    for kind, reason, message in rollout.decision.events:
                        runtime.post_event(body, kind, reason, message)
                    deployment, writes = await _apply_children(
                        runtime, plan, owner, indexes, recent, rollout.children(plan, owner)
                    )
                    if writes:
                        runtime.post_event(
                            body, "Normal", "Applied", f"{', '.join(writes)} ({plan.name})"
                        )
                except KubeError as exc:
                    if exc.is_temporary:
                        raise
                    # The API server refused a child built from this spec: the user must act.
                    error = PlanError(
                        field="spec",
                        value=None,
                        reason="ChildRejected",
                        condition="",
                        message=exc.message,
                    )
                    plan = None
            if error is not None:
                result = "stalled"
                RECONCILE_ERRORS.labels(kind="spec").inc()
            old = dict(body.status)
            new = compute_status(
                plan=plan,
                error=error,
                deployment=deployment,
                old_status=old,
                generation=generation,
                now=_now(),
            )
            if plan is not None and rollout is not None:
                new = rollout_status(rollout.decision, new, old, _now(), generation)
            changes = status_patch(old, new)
            if changes:
                for key, value in changes.items():
                    patch.status[key] = value
                STATUS_WRITES.inc()
                _post_events(runtime.post_event, body, old, new)
        except KubeError as exc:
            result = "retry"
            RECONCILE_ERRORS.labels(kind="api").inc()
            raise kopf.TemporaryError(f"API server: {exc.message}", delay=retry_delay) from exc
        except Exception:
            result = "error"
            RECONCILE_ERRORS.labels(kind="unexpected").inc()
            raise
        finally:
            RECONCILE_TOTAL.labels(trigger=trigger, result=result).inc()
            RECONCILE_DURATION.labels(trigger=trigger).observe(time.monotonic() - started)
