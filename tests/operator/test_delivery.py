"""Model delivery's decisions: which cache entry, whether to fetch, and what waits for it.

`resolve_delivery` and the whole reconcile run against an in-memory API (objects by kind and
name, writes recorded); a running fetch pod's progress is read from the fetcher's own progress
server on a loopback address.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
from collections.abc import Iterator
from typing import Any

import kopf
import pytest

from davit_operator.builders.fetch_job import (
    FETCH_PORT,
    FetchSettings,
    fetch_name,
    model_entry,
)
from davit_operator.builders.metadata import Owner
from davit_operator.catalog.loader import load_catalog
from davit_operator.delivery import resolve_delivery
from davit_operator.fetch.main import Tracker, _serve_progress
from davit_operator.fetch.result import FetchFailure, FetchResult
from davit_operator.fetch.store import entry_key
from davit_operator.planning.errors import PlanError
from davit_operator.planning.plan import Plan, make_plan
from davit_operator.reconcile.indexes import Indexes
from davit_operator.reconcile.memo import ObjectMemo
from davit_operator.reconcile.plan import fetch_failed, with_model_cache
from davit_operator.reconcile.reconciler import reconcile
from davit_operator.reconcile.runtime import EMPTY_DIR_CACHE, Runtime
from tests.operator.isvc_helpers import make_spec, spec_dict

CATALOG = load_catalog()
OWNER = Owner(name="svc", uid="uid-1")
SETTINGS = FetchSettings(image="davit-operator:test", hf_endpoint="http://hub.test")
KEY = entry_key("hf", "Qwen/Qwen3-8B", "main")
NAME = fetch_name(KEY)
_ips = (f"127.77.{i // 250}.{i % 250 + 2}" for i in itertools.count())


class FakeKube:
    """Answers get/list/apply from a dict of objects; records every apply."""

    def __init__(self, *objects: dict[str, Any]) -> None:
        self.objects = {(o["kind"], o["metadata"]["name"]): copy.deepcopy(o) for o in objects}
        self.applied: list[dict[str, Any]] = []

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        found = self.objects.get((kind, name))
        return copy.deepcopy(found) if found else None

    async def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        job = label_selector.removeprefix("job-name=")
        return [
            copy.deepcopy(o)
            for (k, _), o in self.objects.items()
            if k == kind and o.get("metadata", {}).get("labels", {}).get("job-name") == job
        ]

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.applied.append(copy.deepcopy(obj))
        live = copy.deepcopy(obj)
        live["metadata"].update(uid=f"{obj['kind']}-uid", generation=1)
        self.objects[(obj["kind"], obj["metadata"]["name"])] = live
        return live

    def kinds(self) -> list[str]:
        return [o["kind"] for o in self.applied]


def _plan(**model: Any) -> Plan:
    spec = with_model_cache(make_spec(model={"source": "hf://Qwen/Qwen3-8B", **model}), "cache")
    return make_plan("svc", "ns", spec, CATALOG)


def _resolve(kube: FakeKube, plan: Plan | None = None) -> Any:
    return asyncio.run(resolve_delivery(kube, plan or _plan(), OWNER, SETTINGS))  # type: ignore[arg-type]


RESULT = FetchResult(
    source="hf://Qwen/Qwen3-8B",
    revision="main",
    commit="c" * 40,
    path="hf/models--Qwen--Qwen3-8B/snapshots/" + "c" * 40,
    bytes_total=16 << 30,
    bytes_fetched=16 << 30,
)


def _job(*conditions: tuple[str, str]) -> dict[str, Any]:
    return {
        "kind": "Job",
        "metadata": {"name": NAME},
        "status": {
            "conditions": [{"type": t, "status": "True", "reason": r} for t, r in conditions]
        },
    }


def _pod(n: int, *, exit_code: int | None, message: str = "", ip: str = "") -> dict[str, Any]:
    state: dict[str, Any] = {"running": {}}
    phase = "Running"
    if exit_code is not None:
        state = {"terminated": {"exitCode": exit_code, "message": message}}
        phase = "Succeeded" if exit_code == 0 else "Failed"
    return {
        "kind": "Pod",
        "metadata": {
            "name": f"{NAME}-{n}",
            "labels": {"job-name": NAME},
            "creationTimestamp": f"2026-01-01T00:00:0{n}Z",
        },
        "status": {
            "phase": phase,
            "podIP": ip,
            "containerStatuses": [{"name": "fetch", "state": state}],
        },
    }


def test_sources_that_are_not_fetched() -> None:
    for source, state in (
        ("pvc://models/qwen3", "Mounted"),
        ("random://qwen3-8b", "NotNeeded"),
    ):
        spec = make_spec(model={"source": source, "revision": None})
        plan = make_plan("svc", "ns", with_model_cache(spec, "cache"), CATALOG)
        kube = FakeKube()
        delivery = _resolve(kube, plan)
        assert delivery.state == state and delivery.replicas_may_start and kube.applied == []
    plan = make_plan("svc", "ns", with_model_cache(make_spec(), EMPTY_DIR_CACHE), CATALOG)
    delivery = _resolve(FakeKube(), plan)
    assert delivery.state == "Unmanaged" and delivery.replicas_may_start


def test_the_cache_comes_from_the_spec_or_the_operator() -> None:
    spec = with_model_cache(make_spec(), "team-cache")
    assert spec.model.cache.claim_name == "team-cache"
    own = make_spec(model={"cache": {"claimName": "mine"}})
    assert with_model_cache(own, "team-cache").model.cache.claim_name == "mine"
    assert with_model_cache(make_spec(), EMPTY_DIR_CACHE).model.cache.empty_dir
    with pytest.raises(PlanError) as err:
        with_model_cache(make_spec(), None)
    assert err.value.field == "model.cache.claimName" and err.value.reason == "ModelCacheRequired"
    s3 = make_spec(model={"source": "s3://bucket/models/qwen3", "revision": "r1"})
    with pytest.raises(PlanError) as err:
        with_model_cache(s3, EMPTY_DIR_CACHE)
    assert err.value.field == "model.cache.emptyDir"


def test_one_entry_per_source_and_revision_whoever_asks() -> None:
    a = model_entry(_plan(), SETTINGS)
    b = model_entry(
        make_plan("other", "ns", with_model_cache(make_spec(replicas=4), "cache"), CATALOG),
        SETTINGS,
    )
    c = model_entry(_plan(revision="v2"), SETTINGS)
    assert a is not None and b is not None and c is not None
    assert a.key == b.key == KEY and c.key != KEY
    assert a.endpoint == "http://hub.test"
    assert (
        model_entry(_plan(endpoint="http://mirror.test"), SETTINGS).endpoint == "http://mirror.test"
    )  # type: ignore[union-attr]


def test_a_missing_entry_creates_one_fetch_job() -> None:
    kube = FakeKube()
    delivery = _resolve(kube, _plan(credentialsSecret="hf-token"))
    assert delivery.state == "Fetching" and not delivery.replicas_may_start
    assert kube.kinds() == ["Job"] and delivery.action and NAME in delivery.action
    job = kube.applied[0]
    assert job["metadata"]["name"] == NAME
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"][:5] == [
        "fetch",
        "--source",
        "hf://Qwen/Qwen3-8B",
        "--revision",
        "main",
    ]
    assert "--result-file" in container["args"] and "--endpoint" in container["args"]
    assert container["env"] == [
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}}}
    ]
    assert pod["volumes"] == [
        {"name": "model-store", "persistentVolumeClaim": {"claimName": "cache"}}
    ]
    rule = job["spec"]["podFailurePolicy"]["rules"][0]
    assert rule["action"] == "FailJob" and rule["onExitCodes"]["values"] == [3]
    # The next reconcile finds the Job and creates nothing.
    assert _resolve(kube).state == "Fetching" and len(kube.applied) == 1


def test_a_recorded_entry_is_present_and_nothing_is_fetched() -> None:
    record = {
        "kind": "ConfigMap",
        "metadata": {"name": NAME},
        "data": {"result.json": RESULT.to_json()},
    }
    kube = FakeKube(record)
    delivery = _resolve(kube)
    assert delivery.state == "Present" and delivery.replicas_may_start and kube.applied == []
    assert delivery.result == RESULT and "16384.0 MiB" in delivery.message


def test_a_finished_fetch_is_recorded_for_everyone() -> None:
    kube = FakeKube(_job(), _pod(1, exit_code=0, message=RESULT.to_json()))
    delivery = _resolve(kube)
    assert delivery.state == "Present" and delivery.result == RESULT
    (record,) = kube.applied
    assert record["kind"] == "ConfigMap" and record["metadata"]["name"] == NAME
    assert "ownerReferences" not in record["metadata"]  # outlives the service that asked
    assert _resolve(kube).state == "Present" and len(kube.applied) == 1


def test_a_permanent_failure_fails_at_once_and_a_transient_one_retries() -> None:
    failure = FetchFailure("Unauthorized", "HTTP 401 (bad token)")
    kube = FakeKube(_job(), _pod(1, exit_code=3, message=failure.to_json()))
    delivery = _resolve(kube)
    assert delivery.state == "Failed" and delivery.reason == "Unauthorized"
    assert "HTTP 401" in delivery.message and f"delete Job {NAME}" in delivery.message
    error = fetch_failed(delivery)
    assert error.field == "model.credentialsSecret" and error.reason == "Unauthorized"
    retrying = FetchFailure("Transient", "connection reset")
    kube = FakeKube(_job(), _pod(1, exit_code=1, message=retrying.to_json()))
    delivery = _resolve(kube)
    assert delivery.state == "Fetching" and "retrying after: connection reset" in delivery.message
    # The Job's controller gave up (retries spent or deadline): failed with its reason.
    kube = FakeKube(_job(("Failed", "BackoffLimitExceeded")), _pod(1, exit_code=1, message="x"))
    delivery = _resolve(kube)
    assert delivery.state == "Failed" and "BackoffLimitExceeded" in delivery.message


@pytest.mark.parametrize(
    ("reason", "field"),
    [
        ("RevisionNotFound", "model.revision"),
        ("DiskFull", "model.cache.claimName"),
        ("ChecksumMismatch", "model.source"),
    ],
)
def test_failures_name_the_field_to_fix(reason: str, field: str) -> None:
    failure = FetchFailure(reason, "details")  # type: ignore[arg-type]
    kube = FakeKube(_job(), _pod(1, exit_code=3, message=failure.to_json()))
    assert fetch_failed(_resolve(kube)).field == field


@pytest.fixture
def fetching_pod() -> Iterator[tuple[Tracker, str]]:
    tracker, ip = Tracker(), next(_ips)
    server = _serve_progress(tracker, ip, FETCH_PORT)
    try:
        yield tracker, ip
    finally:
        server.shutdown()
        server.server_close()


def test_progress_is_read_from_the_running_fetch(fetching_pod: tuple[Tracker, str]) -> None:
    tracker, ip = fetching_pod
    tracker.start(400 << 20, 5)
    tracker.add(100 << 20)
    kube = FakeKube(_job(), _pod(1, exit_code=None, ip=ip))
    delivery = _resolve(kube)
    assert delivery.state == "Fetching"
    assert delivery.progress.bytes_done == 100 << 20 and delivery.progress.files_total == 5
    assert "100.0 MiB of 400.0 MiB (25%)" in delivery.message


# --- the whole reconcile: what waits for the model -----------------------------------------


def _reconcile(
    kube: FakeKube, indexes: Indexes, body: dict[str, Any], *, profile_memory: bool = False
) -> tuple[kopf.Patch, list[tuple[str, str, str]]]:
    events: list[tuple[str, str, str]] = []
    patch = kopf.Patch()
    asyncio.run(
        reconcile(
            trigger="update",
            runtime=Runtime(
                catalog=CATALOG,
                kube=kube,  # type: ignore[arg-type]
                post_event=lambda _b, t, r, m: events.append((t, r, m)),
                model_cache="cache",
                fetch=SETTINGS,
                profile_memory=profile_memory,
            ),
            body=kopf.Body(body),
            patch=patch,
            indexes=indexes,
            memo=ObjectMemo(),
            retry_delay=1.0,
        )
    )
    return patch, events


def _body(status: dict[str, Any] | None = None, **model: Any) -> dict[str, Any]:
    return {
        "apiVersion": "serving.davit.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "svc", "namespace": "ns", "uid": "uid-1", "generation": 2},
        "spec": spec_dict(model=model) if model else spec_dict(),
        "status": status or {},
    }


def _indexes(*deployments: dict[str, Any]) -> Indexes:
    return Indexes(
        deployments={("ns", "svc"): list(deployments)} if deployments else {},
        services={},
        budgets={},
        nodes={},
    )


def _conditions(patch: kopf.Patch) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in patch["status"]["conditions"]}


def test_nothing_starts_before_the_model_is_there() -> None:
    kube = FakeKube()
    patch, events = _reconcile(kube, _indexes(), _body(), profile_memory=True)
    assert kube.kinds() == ["Job"], "no Deployment, no profiling Job before the model"
    assert kube.applied[0]["metadata"]["name"] == NAME
    conds = _conditions(patch)
    assert (conds["ModelReady"]["status"], conds["ModelReady"]["reason"]) == ("False", "Fetching")
    assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("False", "FetchingModel")
    assert conds["Reconciling"]["reason"] == "FetchingModel"
    assert patch["status"]["model"]["state"] == "Fetching"
    assert ("Normal", "ModelFetch") in [(t, r) for t, r, _ in events]


def test_profiling_starts_once_the_model_is_there() -> None:
    record = {
        "kind": "ConfigMap",
        "metadata": {"name": NAME},
        "data": {"result.json": RESULT.to_json()},
    }
    kube = FakeKube(record)
    _reconcile(kube, _indexes(), _body(), profile_memory=True)
    (job,) = kube.applied
    assert job["kind"] == "Job" and job["metadata"]["name"] != NAME  # the profiling Job
    volume = next(
        v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "model-store"
    )
    assert volume["persistentVolumeClaim"] == {"claimName": "cache", "readOnly": True}


def test_replicas_start_from_the_cache_once_it_is_there() -> None:
    record = {
        "kind": "ConfigMap",
        "metadata": {"name": NAME},
        "data": {"result.json": RESULT.to_json()},
    }
    kube = FakeKube(record)
    patch, _ = _reconcile(kube, _indexes(), _body())
    assert kube.kinds()[0] == "Deployment" and "Job" not in kube.kinds()
    pod = kube.applied[0]["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "model-store")
    assert volume["persistentVolumeClaim"] == {"claimName": "cache", "readOnly": True}
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HUB_CACHE"].endswith("/hf")
    assert patch["status"]["model"]["state"] == "Present"
    assert patch["status"]["model"]["commit"] == RESULT.commit
    assert _conditions(patch)["ModelReady"]["reason"] == "Fetched"


def test_a_new_revision_is_fetched_while_the_running_one_serves() -> None:
    record = {
        "kind": "ConfigMap",
        "metadata": {"name": NAME},
        "data": {"result.json": RESULT.to_json()},
    }
    kube = FakeKube(record)
    _reconcile(kube, _indexes(), _body())
    running = {**kube.applied[0], "metadata": {**kube.applied[0]["metadata"], "uid": "d-uid"}}
    kube.applied.clear()
    patch, _ = _reconcile(kube, _indexes(running), _body(revision="v2"))
    assert kube.kinds() == ["Job"], "the running Deployment is left as it is"
    assert kube.applied[0]["metadata"]["name"] == fetch_name(entry_key("hf", "Qwen/Qwen3-8B", "v2"))
    conds = _conditions(patch)
    assert conds["Reconciling"]["reason"] == "FetchingModel"
    assert "Ready" not in conds or conds["Ready"].get("reason") != "FetchingModel"
    assert patch["status"]["model"]["revision"] == "v2"


def test_a_failed_fetch_stalls_with_its_reason_and_a_warning() -> None:
    failure = FetchFailure("RevisionNotFound", "HTTP 404 RevisionNotFound (Invalid rev id: nope)")
    name = fetch_name(entry_key("hf", "Qwen/Qwen3-8B", "nope"))
    job = {**_job(), "metadata": {"name": name}}
    pod = _pod(1, exit_code=3, message=failure.to_json())
    pod["metadata"]["labels"]["job-name"] = name
    kube = FakeKube(job, pod)
    patch, events = _reconcile(kube, _indexes(), _body(revision="nope"))
    assert kube.applied == []
    conds = _conditions(patch)
    assert (conds["Stalled"]["status"], conds["Stalled"]["reason"]) == ("True", "RevisionNotFound")
    assert conds["ModelReady"]["reason"] == "RevisionNotFound"
    assert "Invalid rev id: nope" in conds["Stalled"]["message"]
    assert ("Warning", "RevisionNotFound") in [(t, r) for t, r, _ in events]
