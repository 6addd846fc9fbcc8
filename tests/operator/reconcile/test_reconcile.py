"""The handler's child reconciliation with a recording client: which writes happen when."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import kopf
import pytest

from davit_operator.builders.children import children
from davit_operator.builders.deployment import engine_deployment
from davit_operator.builders.metadata import Owner
from davit_operator.catalog.loader import load_catalog
from davit_operator.kube import KubeError
from davit_operator.planning.plan import make_plan
from davit_operator.reconcile.apply import apply_children
from davit_operator.reconcile.indexes import Indexes
from davit_operator.reconcile.memo import ObjectMemo
from davit_operator.reconcile.reconciler import reconcile
from davit_operator.reconcile.runtime import EMPTY_DIR_CACHE, Runtime
from tests.operator.isvc_helpers import make_spec, spec_dict

CATALOG = load_catalog()
OWNER = Owner(name="svc", uid="uid-1")
KEY = ("ns", "svc")


class RecordingClient:
    """Stands in for KubeClient: records writes, answers like the API server would."""

    def __init__(self) -> None:
        self.applied: list[str] = []
        self.deleted: list[str] = []

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.applied.append(obj["kind"])
        live = copy.deepcopy(obj)
        live["metadata"]["uid"] = f"{obj['kind']}-uid"
        live["metadata"]["generation"] = 1
        return live

    async def delete(self, kind: str, namespace: str, name: str, uid: str) -> None:
        self.deleted.append(f"{kind}/{namespace}/{name}/{uid}")


class ServerClient(RecordingClient):
    """Also keeps what it applied and answers reads from it, like the API server."""

    def __init__(self) -> None:
        super().__init__()
        self.objects: dict[str, dict[str, Any]] = {}
        self.reads: list[str] = []

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        live = await super().apply(obj)
        self.objects[obj["kind"]] = live
        return live

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads.append(kind)
        return copy.deepcopy(self.objects.get(kind))


def _indexes(**live: dict[str, Any]) -> Indexes:
    def index(kind: str) -> Any:
        return {KEY: [live[kind]]} if kind in live else {}

    return Indexes(
        deployments=index("deployment"),
        services=index("service"),
        budgets=index("poddisruptionbudget"),
        nodes={},
    )


def _run_writes(
    client: RecordingClient, indexes: Indexes, memo: ObjectMemo, **spec: Any
) -> list[str]:
    plan = make_plan("svc", "ns", make_spec(**spec), CATALOG)
    stable = engine_deployment(plan, OWNER, "stable", plan.replicas).manifest
    desired = children(plan, OWNER, [stable])
    kube: Any = client  # answers the calls apply_children makes
    applied = asyncio.run(apply_children(kube, "ns", "svc", desired, indexes, memo))
    return applied.writes


def _run(client: RecordingClient, indexes: Indexes, memo: ObjectMemo, **spec: Any) -> None:
    _run_writes(client, indexes, memo, **spec)


def test_writes_once_even_when_the_watch_lags() -> None:
    client = RecordingClient()
    memo = ObjectMemo()
    _run(client, _indexes(), memo)
    assert client.applied == ["Deployment", "Service"]
    # The watch events have not arrived yet: the own applies stand in for them.
    _run(client, _indexes(), memo)
    assert client.applied == ["Deployment", "Service"]
    deployment = memo.applies["Deployment"].live
    service = memo.applies["Service"].live
    # The watch caught up: no write, and the memory of the applies is dropped.
    _run(client, _indexes(deployment=deployment, service=service), memo)
    assert client.applied == ["Deployment", "Service"] and memo.applies == {}

    drifted = copy.deepcopy(deployment)
    drifted["spec"]["template"]["spec"]["containers"][0]["image"] = "someone/else:1"
    _run(client, _indexes(deployment=drifted, service=service), memo)
    assert client.applied == ["Deployment", "Service", "Deployment"]


def test_a_watch_lagging_past_the_window_costs_a_read_not_a_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [1000.0]
    monkeypatch.setattr("davit_operator.reconcile.apply.time.monotonic", lambda: clock[0])
    client = ServerClient()
    memo = ObjectMemo()
    _run(client, _indexes(), memo)
    assert client.applied == ["Deployment", "Service"] and client.reads == []
    # Two minutes on, the watch has still shown neither child: the server has both.
    clock[0] += 120
    _run(client, _indexes(), memo)
    assert client.applied == ["Deployment", "Service"]
    assert client.reads == ["Deployment", "Service"]
    # Inside the renewed window, no more reads.
    _run(client, _indexes(), memo)
    assert client.reads == ["Deployment", "Service"]
    # Someone deleted the Service meanwhile: past the window the read finds nothing, and
    # only the Service is applied again.
    del client.objects["Service"]
    clock[0] += 120
    _run(client, _indexes(), memo)
    assert client.applied == ["Deployment", "Service", "Service"]
    assert client.reads[2:] == ["Deployment", "Service"]


def test_budget_follows_the_replica_count() -> None:
    client = RecordingClient()
    memo = ObjectMemo()
    _run(client, _indexes(), memo, replicas=2)
    assert client.applied == ["Deployment", "Service", "PodDisruptionBudget"]
    live = {kind.lower(): recent.live for kind, recent in memo.applies.items()}
    memo.applies.clear()
    writes = _run_writes(client, _indexes(**live), memo, replicas=1)
    assert writes == ["applied Deployment", "deleted PodDisruptionBudget"]
    assert client.applied[3:] == ["Deployment"]
    assert client.deleted == ["PodDisruptionBudget/ns/svc/PodDisruptionBudget-uid"]
    # The watch still shows the deleted budget: it is not deleted twice.
    live["deployment"] = memo.applies["Deployment"].live
    assert _run_writes(client, _indexes(**live), memo, replicas=1) == []
    assert len(client.deleted) == 1


class FailingClient(RecordingClient):
    def __init__(self, status: int) -> None:
        super().__init__()
        self.status = status

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        raise KubeError(self.status, f"PATCH deployments/{obj['metadata']['name']}: refused")


EVENTS: list[tuple[str, str, str]] = []


def _record(body: kopf.Body, type: str, reason: str, message: str) -> None:
    EVENTS.append((type, reason, message))


def _reconcile(client: RecordingClient, body: dict[str, Any]) -> kopf.Patch:
    patch = kopf.Patch()
    EVENTS.clear()
    asyncio.run(
        reconcile(
            trigger="create",
            runtime=Runtime(
                catalog=CATALOG,
                kube=client,  # type: ignore[arg-type]
                post_event=_record,
                # These specs name hf:// models: opt out of the cache (no fetch Job here).
                model_cache=EMPTY_DIR_CACHE,
            ),
            body=kopf.Body(body),
            patch=patch,
            indexes=_indexes(),
            memo=ObjectMemo(),
            retry_delay=1.0,
        )
    )
    return patch


BODY: dict[str, Any] = {
    "apiVersion": "serving.davit.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "svc", "namespace": "ns", "uid": "uid-1", "generation": 3},
    "spec": spec_dict(),
}


def test_api_hiccups_are_retried() -> None:
    with pytest.raises(kopf.TemporaryError) as err:
        _reconcile(FailingClient(503), BODY)
    assert "API server" in str(err.value) and err.value.delay == 1.0


def test_a_refused_child_stalls_with_the_servers_message() -> None:
    patch = _reconcile(FailingClient(422), BODY)
    status = patch["status"]
    assert status["observedGeneration"] == 3
    stalled = next(c for c in status["conditions"] if c["type"] == "Stalled")
    assert stalled["status"] == "True" and stalled["reason"] == "ChildRejected"
    assert "deployments/svc: refused" in stalled["message"]
    assert [("Warning", "ChildRejected", stalled["message"])] == EVENTS


def test_first_reconcile_writes_children_and_status() -> None:
    client = RecordingClient()
    patch = _reconcile(client, BODY)
    assert client.applied == ["Deployment", "Service"]
    status = patch["status"]
    assert status["artifact"]["image"] == "ghcr.io/davit-dev/davit-engine:0.1.0-cuda13.0"
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["reason"] == "RolloutPending"
    assert [
        ("Normal", "Applied", "applied Deployment, applied Service (svc)"),
        ("Normal", "RolloutPending", f"Ready=False: {ready['message']}"),
    ] == EVENTS
