"""Thin kopf handlers: parse, plan, apply, write status through kopf's patch.

Every trigger (create, update, resume, and the periodic drift timer) runs the same level-based
`reconcile`: it computes the whole desired state, writes only children that differ from it, and
patches only status fields that changed. Live children come from kopf indexes fed by watches,
so an idle reconcile makes no API request at all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import kopf
from pydantic import ValidationError

from davit_operator.api import GROUP, PLURAL, VERSION
from davit_operator.api.spec import InferenceServiceSpec
from davit_operator.builders import INSTANCE_LABEL, MANAGED_BY, Owner, children
from davit_operator.catalog import Catalog, default_catalog
from davit_operator.kube import (
    DESIRED_HASH_ANNOTATION,
    KubeClient,
    KubeError,
    load_credentials,
    needs_apply,
    with_hash,
)
from davit_operator.metrics import (
    CHILD_WRITES,
    RECONCILE_DURATION,
    RECONCILE_ERRORS,
    RECONCILE_TOTAL,
    STATUS_WRITES,
)
from davit_operator.planning import NodeFacts, Plan, PlanError, make_plan
from davit_operator.status import compute_status, status_patch

CHILD_LABELS = {"app.kubernetes.io/managed-by": MANAGED_BY}
# How long an own apply stands in for a watch event that has not arrived yet.
RECENT_APPLY_SECONDS = 60.0


@dataclass(frozen=True)
class OperatorOptions:
    """Settings chosen on the command line."""

    drift_interval: float = 10.0
    kubeconfig: str | None = None
    peering: str | None = None
    retry_delay: float = 5.0


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


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _strip(body: kopf.Body) -> dict[str, Any]:
    """A compact copy of a watched object: managedFields are large and never needed."""
    obj = {"metadata": dict(body.metadata), "spec": dict(body.spec), "status": dict(body.status)}
    obj["metadata"].pop("managedFields", None)
    return obj


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
    new: dict[str, Any],
) -> None:
    """One event per state change: Ready's status or reason, Stalled's status."""
    before = {c.get("type"): c for c in old.get("conditions") or []}
    after = {c["type"]: c for c in new.get("conditions") or []}
    ready, stalled = after.get("Ready"), after.get("Stalled")
    prior_ready, prior_stalled = before.get("Ready"), before.get("Stalled")
    if stalled and stalled["status"] == "True":
        if (
            not prior_stalled
            or prior_stalled.get("status") != "True"
            or (prior_stalled.get("reason") != stalled["reason"])
        ):
            post(body, "Warning", stalled["reason"], stalled["message"])
        return
    if prior_stalled and prior_stalled.get("status") == "True":
        post(body, "Normal", "Recovered", "no longer stalled")
    if ready and (
        not prior_ready
        or (prior_ready.get("status"), prior_ready.get("reason"))
        != (ready["status"], ready["reason"])
    ):
        post(body, "Normal", ready["reason"], f"Ready={ready['status']}: {ready['message']}")


async def _apply_children(
    runtime: Runtime,
    plan: Plan,
    owner: Owner,
    indexes: dict[str, kopf.Index[Any, Any]],
    recent: dict[str, tuple[str, dict[str, Any], float]],
) -> tuple[dict[str, Any] | None, list[str]]:
    """Apply what differs; delete a PodDisruptionBudget no longer wanted. Returns the live
    Deployment (fresh from the apply when one happened, else from the index) and the writes
    made ("applied Deployment", "deleted PodDisruptionBudget").

    `recent` remembers this object's own applies (kind -> hash, response, time) until the watch
    cache shows them: a reconcile that runs before the watch event arrives must not apply again.
    """
    key = (plan.namespace, plan.name)
    live_deployment: dict[str, Any] | None = _first(indexes["deployment"], key)
    wanted_kinds = set()
    writes: list[str] = []
    now = time.monotonic()
    for desired in children(plan, owner):
        kind = desired["kind"]
        wanted_kinds.add(kind)
        live = _first(indexes[kind.lower()], key)
        obj = with_hash(desired)
        wanted_hash = obj["metadata"]["annotations"][DESIRED_HASH_ANNOTATION]
        if kind in recent:
            applied_hash, response, at = recent[kind]
            if _hash_of(live) == applied_hash or now - at > RECENT_APPLY_SECONDS:
                del recent[kind]
            elif applied_hash == wanted_hash:
                live = response
                if kind == "Deployment":
                    live_deployment = response
        if not needs_apply(obj, live):
            continue
        applied = await runtime.kube.apply(obj)
        recent[kind] = (wanted_hash, applied, now)
        CHILD_WRITES.labels(kind=kind, action="apply").inc()
        writes.append(f"applied {kind}")
        if kind == "Deployment":
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
                plan = make_plan(name, namespace, spec, runtime.catalog, _nodes(indexes["node"]))
            except ValidationError as exc:
                error = _spec_error(exc)
            except PlanError as exc:
                error = exc
            deployment = _first(indexes["deployment"], (namespace, name))
            if plan is not None:
                try:
                    deployment, writes = await _apply_children(
                        runtime, plan, Owner(name=name, uid=uid), indexes, recent
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


def register(registry: kopf.OperatorRegistry, options: OperatorOptions) -> None:
    """Register every handler on `registry` with the given options."""
    resource = (GROUP, VERSION, PLURAL)

    @kopf.on.startup(registry=registry, id="configure")
    async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        # Progress and the last-handled spec live in annotations under our group: the status
        # schema is typed and has no room for kopf's bookkeeping.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=GROUP, key="last-handled-configuration"
        )
        # The timer needs a finalizer so kopf can stop it before the object goes; children
        # are garbage-collected through their owner references, not by a deletion handler.
        settings.persistence.finalizer = f"{GROUP}/finalizer"
        settings.posting.level = logging.INFO
        # Bounded waits everywhere: a stuck connection is dropped and retried instead of
        # stalling the watches (and with them every handler) for minutes.
        settings.watching.connect_timeout = 10
        settings.watching.server_timeout = 120
        settings.watching.client_timeout = 150
        settings.networking.connect_timeout = 10
        settings.networking.request_timeout = 30
        settings.peering.standalone = options.peering is None
        if options.peering is not None:
            # Needs kopf's peering resources installed; kopf picks their scope from the
            # operator's own (namespaced or cluster-wide).
            settings.peering.name = options.peering
        memo.runtime = Runtime(
            catalog=default_catalog(),
            kube=KubeClient(load_credentials(options.kubeconfig)),
        )

    @kopf.on.login(registry=registry, id="login")
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # A private registry gets none of kopf's default login handlers; use the same
        # kubeconfig / in-cluster discovery as the children's client.
        return kopf.login_via_client(**kwargs)

    @kopf.on.cleanup(registry=registry, id="close")
    async def close(memo: kopf.Memo, **_: Any) -> None:
        runtime: Runtime | None = getattr(memo, "runtime", None)
        if runtime is not None:
            await runtime.kube.close()

    @kopf.index(
        "apps", "v1", "deployments", labels=CHILD_LABELS, registry=registry, id="deployment_index"
    )
    def deployment_index(
        namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
    ) -> dict[Any, Any] | None:
        owner = labels.get(INSTANCE_LABEL)
        return {(namespace, owner): _strip(body)} if owner else None

    @kopf.index("v1", "services", labels=CHILD_LABELS, registry=registry, id="service_index")
    def service_index(
        namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
    ) -> dict[Any, Any] | None:
        owner = labels.get(INSTANCE_LABEL)
        return {(namespace, owner): _strip(body)} if owner else None

    @kopf.index(
        "policy",
        "v1",
        "poddisruptionbudgets",
        labels=CHILD_LABELS,
        registry=registry,
        id="pdb_index",
    )
    def pdb_index(
        namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
    ) -> dict[Any, Any] | None:
        owner = labels.get(INSTANCE_LABEL)
        return {(namespace, owner): _strip(body)} if owner else None

    @kopf.index("v1", "nodes", registry=registry, id="node_index")
    def node_index(name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
        return {
            name: NodeFacts(
                name=name,
                labels=dict(body.metadata.labels),
                allocatable=dict(body.status.get("allocatable") or {}),
                unschedulable=bool(body.spec.get("unschedulable", False)),
                taints=tuple(dict(t) for t in body.spec.get("taints") or ()),
            )
        }

    async def run(
        trigger: str, memo: kopf.Memo, body: kopf.Body, patch: kopf.Patch, **kw: Any
    ) -> None:
        await reconcile(
            trigger=trigger,
            runtime=memo.runtime,
            body=body,
            patch=patch,
            indexes={
                "deployment": kw["deployment_index"],
                "service": kw["service_index"],
                "poddisruptionbudget": kw["pdb_index"],
                "node": kw["node_index"],
            },
            retry_delay=options.retry_delay,
            # kopf gives each object its own memo (dropped with the object): one lock per object.
            lock=memo.setdefault("reconcile_lock", asyncio.Lock()),
            recent=memo.setdefault("recent_applies", {}),
        )

    @kopf.on.resume(*resource, registry=registry, backoff=options.retry_delay, id="resume")
    async def on_resume(**kwargs: Any) -> None:
        await run("resume", **kwargs)

    @kopf.on.create(*resource, registry=registry, backoff=options.retry_delay, id="create")
    async def on_create(**kwargs: Any) -> None:
        await run("create", **kwargs)

    @kopf.on.update(*resource, registry=registry, backoff=options.retry_delay, id="update")
    async def on_update(**kwargs: Any) -> None:
        await run("update", **kwargs)

    @kopf.timer(
        *resource,
        registry=registry,
        id="drift",
        interval=options.drift_interval,
        initial_delay=options.drift_interval,
    )
    async def drift(**kwargs: Any) -> None:
        await run("timer", **kwargs)
