"""Step two of a reconcile: write the children that differ from what the plan wants.

Live children come from the watch caches; a child is applied only when `needs_apply` says its
desired state changed or someone changed a field the operator owns. The object's memo remembers
its own applies until the watch shows them, so a reconcile that runs before the watch event
arrives does not apply the same object again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import kopf

from davit_operator.builders.digest import DESIRED_HASH_ANNOTATION, with_hash
from davit_operator.kube import KubeClient, KubeError, needs_apply
from davit_operator.metrics import CHILD_WRITES
from davit_operator.reconcile.indexes import Indexes, KubeObject
from davit_operator.reconcile.memo import (
    RECENT_WRITE_SECONDS,
    ObjectMemo,
    RecentApply,
    RecentDelete,
)
from davit_operator.reconcile.plan import Planned, Subject, child_rejected
from davit_operator.reconcile.replicas import observed_replicas
from davit_operator.reconcile.runtime import Runtime
from davit_operator.rollout.controller import apply_rollout_effects

# Children that come and go with the spec: a PodDisruptionBudget for more than one replica, the
# autoscaler of spec.autoscaling, the InferencePool and HTTPRoute of spec.routing.
OPTIONAL_KINDS = ("PodDisruptionBudget", "HorizontalPodAutoscaler", "InferencePool", "HTTPRoute")


@dataclass(frozen=True)
class Applied:
    """The live stable Deployment after the writes (fresh from the apply when one happened,
    else from the watch cache) and the writes made ("applied Deployment", "deleted ...")."""

    deployment: KubeObject | None
    writes: list[str]


@dataclass(frozen=True)
class Outcome:
    """What the report describes: the plan as it stands after the writes (a child the API
    server refused turns it into a refusal), the live stable Deployment, and the engine pods
    of every track as the watch last saw them."""

    planned: Planned
    deployment: KubeObject | None
    replicas: int = 0


def _hash_of(obj: KubeObject | None) -> str | None:
    if obj is None:
        return None
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    value = annotations.get(DESIRED_HASH_ANNOTATION)
    return str(value) if value is not None else None


async def apply_children(
    kube: KubeClient,
    namespace: str,
    name: str,
    desired: Sequence[KubeObject],
    indexes: Indexes,
    memo: ObjectMemo,
) -> Applied:
    """Apply what differs among `desired` (the children of the InferenceService `name`);
    delete an optional child (`OPTIONAL_KINDS`) no longer wanted."""
    key = (namespace, name)
    live_deployment = indexes.named("Deployment", key, name)
    wanted_kinds = set()
    writes: list[str] = []
    now = time.monotonic()
    for child in desired:
        kind = child["kind"]
        child_name = child["metadata"]["name"]
        # A rollout's canary Deployment shares the owner key with the stable one.
        memo_key = kind if child_name == name else f"{kind}/{child_name}"
        is_main_deployment = kind == "Deployment" and child_name == name
        wanted_kinds.add(kind)
        live = indexes.named(kind, key, child_name)
        obj = with_hash(child)
        wanted_hash = obj["metadata"]["annotations"][DESIRED_HASH_ANNOTATION]
        recent = memo.applies.get(memo_key)
        ask_server = False
        if recent is not None:
            if _hash_of(live) == recent.desired_hash:
                del memo.applies[memo_key]
            elif now - recent.at > RECENT_WRITE_SECONDS:
                # The watch has not shown this process's own write for a long time: either
                # the cache lags (an API server busy with a thousand new objects) or someone
                # else changed or deleted the child. The server tells which before any write.
                del memo.applies[memo_key]
                ask_server = recent.desired_hash == wanted_hash
            elif recent.desired_hash == wanted_hash:
                live = recent.live
                if is_main_deployment:
                    live_deployment = recent.live
        if ask_server and needs_apply(obj, live):
            fetched = await kube.get(kind, namespace, child_name)
            if fetched is not None and not needs_apply(obj, fetched):
                memo.applies[memo_key] = RecentApply(wanted_hash, fetched, now)
                if is_main_deployment:
                    live_deployment = fetched
                continue
        if not needs_apply(obj, live):
            continue
        applied = await kube.apply(obj)
        memo.applies[memo_key] = RecentApply(wanted_hash, applied, now)
        CHILD_WRITES.labels(kind=kind, action="apply").inc()
        writes.append(f"applied {kind}" + ("" if child_name == name else f" {child_name}"))
        if is_main_deployment:
            live_deployment = applied
    for kind in OPTIONAL_KINDS:
        stale = indexes.first(kind, key)
        if kind in wanted_kinds or stale is None:
            continue
        uid = stale["metadata"]["uid"]
        # A child deleted moments ago can linger in the watch cache: delete it once.
        previous = memo.deletes.get(kind)
        if previous is None or previous.uid != uid or now - previous.at > RECENT_WRITE_SECONDS:
            await kube.delete(kind, namespace, stale["metadata"]["name"], uid)
            memo.deletes[kind] = RecentDelete(uid, now)
            CHILD_WRITES.labels(kind=kind, action="delete").inc()
            writes.append(f"deleted {kind}")
    return Applied(live_deployment, writes)


async def apply_planned(
    runtime: Runtime,
    body: kopf.Body,
    subject: Subject,
    planned: Planned,
    indexes: Indexes,
    memo: ObjectMemo,
) -> Outcome:
    """Carry out the rollout's effects and apply the children, posting an event per write."""
    deployment = indexes.named("Deployment", subject.key, subject.name)
    replicas = observed_replicas(indexes.deployments_by_name(subject.key).values())
    rollout = planned.rollout
    if planned.plan is None or rollout is None:
        return Outcome(planned, deployment, replicas)
    try:
        effects = await apply_rollout_effects(runtime.kube, subject.namespace, rollout)
        if effects:
            runtime.post_event(body, "Normal", "Applied", ", ".join(effects))
        for kind, reason, message in rollout.decision.events:
            runtime.post_event(body, kind, reason, message)
        applied = await apply_children(
            runtime.kube,
            subject.namespace,
            subject.name,
            planned.desired_children(subject.owner),
            indexes,
            memo,
        )
    except KubeError as exc:
        if exc.is_temporary:
            raise
        return Outcome(replace(planned, plan=None, error=child_rejected(exc)), deployment, replicas)
    if applied.writes:
        runtime.post_event(
            body, "Normal", "Applied", f"{', '.join(applied.writes)} ({subject.name})"
        )
    return Outcome(planned, applied.deployment, replicas)
