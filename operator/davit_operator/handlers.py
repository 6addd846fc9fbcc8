"""Thin kopf handlers: register the triggers, indexes and settings; `reconcile` does the work.

Every trigger (create, update, resume, and the periodic drift timer) runs the same level-based
`reconcile.reconciler.reconcile`. Indexes over the operator's Deployments, Services,
PodDisruptionBudgets, HorizontalPodAutoscalers, InferencePools and HTTPRoutes and the cluster's
Nodes give it live state without API requests.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import kopf

from davit_operator.api.identity import GROUP, PLURAL, VERSION
from davit_operator.builders.fetch_job import FetchSettings
from davit_operator.builders.metadata import INSTANCE_LABEL, MANAGED_BY
from davit_operator.catalog.loader import default_catalog
from davit_operator.kube import KubeClient, load_credentials
from davit_operator.model_config import ModelConfigSource
from davit_operator.planning.placement import NodeFacts
from davit_operator.reconcile.indexes import Indexes, KubeObject, ObjectKey, node_facts, watched
from davit_operator.reconcile.memo import ObjectMemo
from davit_operator.reconcile.reconciler import reconcile
from davit_operator.reconcile.runtime import Runtime

CHILD_LABELS = {"app.kubernetes.io/managed-by": MANAGED_BY}


@dataclass(frozen=True)
class OperatorOptions:
    """Settings chosen on the command line."""

    drift_interval: float = 10.0
    kubeconfig: str | None = None
    peering: str | None = None
    retry_delay: float = 5.0
    profile_memory: bool = True
    model_config_url: str | None = None
    model_cache: str | None = None
    fetch: FetchSettings = FetchSettings()


# Reconciles share one pool of API connections (davit_operator.kube), whose requests time out
# while they wait for a connection. At most this many reconciles run at once and the others wait
# their turn before sending anything: 1,000 services created at once otherwise queued thousands
# of requests, most timed out in the pool, and their handlers retried from the start, so almost
# nothing got through.
MAX_CONCURRENT_RECONCILES = 16
# Drift checks take at most this many of those, and a check that would have to wait skips its
# round (the next one comes an interval later), so timers never delay creations and updates.
MAX_CONCURRENT_DRIFT_CHECKS = 8

# The kinds the operator creates, each indexed by its owning InferenceService under this id
# (the reconciler reads the indexes by id). The routing kinds come from optional CRDs: kopf
# watches them once they are installed.
CHILD_INDEXES: dict[str, tuple[str, ...]] = {
    "deployment_index": ("apps", "v1", "deployments"),
    "service_index": ("v1", "services"),
    "pdb_index": ("policy", "v1", "poddisruptionbudgets"),
    "hpa_index": ("autoscaling", "v2", "horizontalpodautoscalers"),
    "pool_index": ("inference.networking.k8s.io", "v1", "inferencepools"),
    "route_index": ("gateway.networking.k8s.io", "v1", "httproutes"),
}


def _child_index(
    namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[ObjectKey, KubeObject] | None:
    """A child under the InferenceService its instance label names."""
    owner = labels.get(INSTANCE_LABEL)
    return {(namespace, owner): watched(body)} if owner else None


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
            kube=KubeClient(
                load_credentials(options.kubeconfig),
                reload=lambda: load_credentials(options.kubeconfig),
            ),
            profile_memory=options.profile_memory,
            model_configs=(
                ModelConfigSource(options.model_config_url) if options.model_config_url else None
            ),
            model_cache=options.model_cache,
            fetch=options.fetch,
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

    for index_id, child_kind in CHILD_INDEXES.items():
        kopf.index(*child_kind, labels=CHILD_LABELS, registry=registry, id=index_id)(_child_index)

    @kopf.index("v1", "nodes", registry=registry, id="node_index")
    def node_index(name: str, body: kopf.Body, **_: Any) -> dict[str, NodeFacts]:
        return {name: node_facts(name, body)}

    reconcile_slots = asyncio.Semaphore(MAX_CONCURRENT_RECONCILES)
    drift_slots = asyncio.Semaphore(MAX_CONCURRENT_DRIFT_CHECKS)

    async def run(
        trigger: str, memo: kopf.Memo, body: kopf.Body, patch: kopf.Patch, **kw: Any
    ) -> None:
        async with reconcile_slots:
            await reconcile(
                trigger=trigger,
                runtime=memo.runtime,
                body=body,
                patch=patch,
                indexes=Indexes(
                    deployments=kw["deployment_index"],
                    services=kw["service_index"],
                    budgets=kw["pdb_index"],
                    nodes=kw["node_index"],
                    autoscalers=kw["hpa_index"],
                    pools=kw["pool_index"],
                    routes=kw["route_index"],
                ),
                # kopf gives each object its own memo (dropped with the object).
                memo=memo.setdefault("reconcile", ObjectMemo()),
                retry_delay=options.retry_delay,
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
    async def drift(memo: kopf.Memo, **kwargs: Any) -> None:
        state = memo.get("reconcile")
        busy = drift_slots.locked() or reconcile_slots.locked()
        if busy or (isinstance(state, ObjectMemo) and state.lock.locked()):
            return  # the operator is busy, or a handler reconciles this object right now
        async with drift_slots:
            await run("timer", memo=memo, **kwargs)
