"""Model delivery: find a model's cache entry, or fetch it once with a Job and record it.
The only part of model delivery that talks to the API server (through KubeClient), in the
manner of `profiling`.

Storage: the fetched files live on the cache claim; one ConfigMap per entry (named and
labelled by the entry key, no owner) records the fetcher's result, so every InferenceService
of that (source, revision) in the namespace finds it and fetches nothing.

States of one reconcile:
- no fetched source (pvc://, random://) or the cache opted out: nothing to do;
- ConfigMap present: the model is present;
- no ConfigMap, no Job: the Job is created; fetching (replicas and profiling wait);
- a Job pod succeeded with a result: the result is recorded; present;
- a Job pod failed for good (its failure document), or the Job failed: failed with the reason;
- otherwise fetching, with the bytes done and total read from the running pod's progress.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from davit_operator.builders.fetch_job import (
    FETCH_CONTAINER,
    FETCH_PORT,
    FetchSettings,
    ModelEntry,
    entry_record,
    fetch_job,
    fetch_name,
    model_entry,
)
from davit_operator.builders.metadata import Owner
from davit_operator.fetch.result import (
    FetchFailure,
    FetchResult,
    Progress,
    parse_outcome,
    parse_progress,
)
from davit_operator.kube import KubeClient
from davit_operator.planning.plan import Plan

logger = logging.getLogger(__name__)

PROGRESS_TIMEOUT_SECONDS = 1.0
DeliveryState = Literal["Present", "Fetching", "Failed", "Mounted", "Unmanaged", "NotNeeded"]


@dataclass(frozen=True)
class Delivery:
    """Where the model stands. `reason` is the fetch failure's reason when Failed."""

    state: DeliveryState
    message: str
    entry: ModelEntry | None = None
    reason: str | None = None
    progress: Progress | None = None
    result: FetchResult | None = None
    action: str | None = None  # what this reconcile did, for an event

    @property
    def replicas_may_start(self) -> bool:
        return self.state not in ("Fetching", "Failed")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _unfetched(plan: Plan) -> Delivery:
    model = plan.spec.model
    scheme = model.source.partition("://")[0]
    if scheme == "pvc":
        return Delivery("Mounted", f"{model.source} is mounted read-only as it is")
    if scheme == "random":
        return Delivery("NotNeeded", "random weights: nothing to fetch")
    return Delivery(
        "Unmanaged",
        "model.cache.emptyDir: the pods start with an empty Hugging Face home and must find "
        "or fetch the model themselves",
    )


def _terminated(pod: dict[str, Any]) -> dict[str, Any] | None:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == FETCH_CONTAINER:
            terminated = (status.get("state") or {}).get("terminated")
            return dict(terminated) if terminated else None
    return None


async def _read_progress(pod: dict[str, Any]) -> Progress | None:
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    try:
        async with httpx.AsyncClient(timeout=PROGRESS_TIMEOUT_SECONDS) as client:
            response = await client.get(f"http://{ip}:{FETCH_PORT}/progress")
    except httpx.HTTPError:
        return None  # not listening yet, or not reachable from the operator
    return parse_progress(response.text) if response.status_code == 200 else None


def _failed(entry: ModelEntry, failure: FetchFailure, job: str) -> Delivery:
    return Delivery(
        "Failed",
        f"fetching {entry.source} revision {entry.revision} failed ({failure.reason}): "
        f"{failure.message}; fix the spec or the source, then delete Job {job} to fetch again",
        entry=entry,
        reason=failure.reason,
    )


async def resolve_delivery(
    kube: KubeClient, plan: Plan, owner: Owner, settings: FetchSettings
) -> Delivery:
    """See the module docstring. Raises KubeError for API errors (the caller retries them)."""
    entry = model_entry(plan, settings)
    if entry is None:
        return _unfetched(plan)
    name = fetch_name(entry.key)
    namespace = plan.namespace
    stored = await kube.get("ConfigMap", namespace, name)
    if stored is not None:
        outcome = parse_outcome((stored.get("data") or {}).get("result.json", ""))
        result = outcome if isinstance(outcome, FetchResult) else None
        size = f", {_mib(result.bytes_total)}" if result is not None else ""
        commit = f" ({result.commit})" if result is not None else ""
        return Delivery(
            "Present",
            f"{entry.source} revision {entry.revision}{commit} is in the model cache "
            f"{entry.claim}{size}",
            entry=entry,
            result=result,
        )
    job = await kube.get("Job", namespace, name)
    if job is None:
        await kube.apply(fetch_job(plan, entry, owner, settings))
        logger.info("%s/%s: created fetch Job %s", namespace, plan.name, name)
        return Delivery(
            "Fetching",
            f"fetch Job {name} created for {entry.source} revision {entry.revision}",
            entry=entry,
            action=f"created fetch Job {name} for {entry.source} revision {entry.revision}",
        )
    pods = await kube.list("Pod", namespace, f"job-name={name}")
    failure: FetchFailure | None = None
    running: dict[str, Any] | None = None
    for pod in sorted(pods, key=lambda p: str((p.get("metadata") or {}).get("creationTimestamp"))):
        terminated = _terminated(pod)
        if terminated is None:
            if (pod.get("status") or {}).get("phase") == "Running":
                running = pod
            continue
        outcome = parse_outcome(str(terminated.get("message") or ""))
        if int(terminated.get("exitCode", 1)) == 0 and isinstance(outcome, FetchResult):
            await kube.apply(entry_record(namespace, entry.key, outcome.to_json()))
            logger.info("%s/%s: recorded model cache entry %s", namespace, plan.name, name)
            return Delivery(
                "Present",
                f"{entry.source} revision {entry.revision} ({outcome.commit}) fetched into the "
                f"model cache {entry.claim}: {_mib(outcome.bytes_total)}",
                entry=entry,
                result=outcome,
                action=f"fetched {entry.source} revision {entry.revision}: "
                f"{_mib(outcome.bytes_fetched)} transferred of {_mib(outcome.bytes_total)}",
            )
        if isinstance(outcome, FetchFailure):
            failure = outcome
    conditions = (job.get("status") or {}).get("conditions") or []
    job_failed = next(
        (c for c in conditions if c.get("type") == "Failed" and c.get("status") == "True"), None
    )
    job_complete = any(
        c.get("type") == "Complete" and c.get("status") == "True" for c in conditions
    )
    if job_complete:
        failure = FetchFailure(
            "InvalidSource",
            f"the fetch Job {name} completed without a result in its pod's termination message "
            "(is --fetch-image an image with `davit fetch`?)",
        )
    if job_complete or job_failed is not None or (failure is not None and failure.permanent):
        if failure is None:
            failure = FetchFailure(
                "Transient",
                f"the Job failed: {job_failed.get('reason') if job_failed else ''} "
                f"{job_failed.get('message', '') if job_failed else ''}".strip(),
            )
        return _failed(entry, failure, name)
    progress = await _read_progress(running) if running is not None else None
    retrying = f" (retrying after: {failure.message})" if failure is not None else ""
    if progress is not None and progress.bytes_total:
        percent = 100.0 * progress.bytes_done / progress.bytes_total
        message = (
            f"fetching {entry.source} revision {entry.revision}: "
            f"{_mib(progress.bytes_done)} of {_mib(progress.bytes_total)} ({percent:.0f}%)"
        )
    else:
        message = f"fetch Job {name} is running for {entry.source} revision {entry.revision}"
    return Delivery("Fetching", message + retrying, entry=entry, progress=progress)
