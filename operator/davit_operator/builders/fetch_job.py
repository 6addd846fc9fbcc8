"""The model fetch Job: copies one (source, revision) into the model cache claim.

One Job per cache entry, named by the entry key (`davit_operator.fetch.store.entry_key`), so
every InferenceService and replica that needs the same revision shares one fetch. The Job
runs `davit fetch` on the replicas' nodes (their node selector and tolerations, no
accelerators) with the claim mounted read-write; credentials reach it only as
`secretKeyRef`s. A permanent failure (exit PERMANENT_EXIT: missing revision, 401/403,
checksum mismatch, full disk) fails the Job at once through its pod failure policy; other
failures are retried by the Job and resume the partial files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from davit_operator.api.identity import GROUP
from davit_operator.builders.metadata import MANAGED_BY, Owner, owner_reference
from davit_operator.fetch.result import PERMANENT_EXIT
from davit_operator.fetch.store import entry_key
from davit_operator.planning.args import MODEL_STORE_DIR
from davit_operator.planning.plan import Plan

ENTRY_LABEL = f"{GROUP}/model-entry"
FETCH_PORT = 8090
TERMINATION_LOG = "/dev/termination-log"
FETCH_CONTAINER = "fetch"
FETCH_RETRIES = 4
FETCH_DEADLINE_SECONDS = 12 * 3600
FETCH_TTL_SECONDS = 24 * 3600
DEFAULT_FETCH_IMAGE = "ghcr.io/davit-dev/davit-operator:0.1.0"
HF_CREDENTIALS = (("HF_TOKEN", False),)
S3_CREDENTIALS = (
    ("AWS_ACCESS_KEY_ID", False),
    ("AWS_SECRET_ACCESS_KEY", False),
    ("AWS_SESSION_TOKEN", True),
)


@dataclass(frozen=True)
class FetchSettings:
    """The operator's side of fetching: the image the Job runs and its defaults."""

    image: str = DEFAULT_FETCH_IMAGE
    hf_endpoint: str | None = None
    s3_endpoint: str | None = None
    max_bytes_per_second: int | None = None


@dataclass(frozen=True)
class ModelEntry:
    """One (source, revision) in the model cache claim."""

    scheme: str
    location: str  # ORG/NAME or BUCKET/PREFIX
    revision: str
    claim: str
    endpoint: str | None
    credentials_secret: str | None

    @property
    def key(self) -> str:
        return entry_key(self.scheme, self.location, self.revision)

    @property
    def source(self) -> str:
        return f"{self.scheme}://{self.location}"


def fetch_name(key: str) -> str:
    """Name of the fetch Job and of the ConfigMap that records the complete entry."""
    return f"davit-model-{key}"


def model_entry(plan: Plan, settings: FetchSettings) -> ModelEntry | None:
    """The cache entry `plan` needs, or None when its model is not fetched (pvc://, random://,
    or the cache opted out)."""
    model = plan.spec.model
    scheme, _, location = model.source.partition("://")
    claim = model.cache.claim_name
    if scheme not in ("hf", "s3") or claim is None or model.revision is None:
        return None
    default = settings.hf_endpoint if scheme == "hf" else settings.s3_endpoint
    return ModelEntry(
        scheme=scheme,
        location=location,
        revision=model.revision,
        claim=claim,
        endpoint=model.endpoint or default,
        credentials_secret=model.credentials_secret,
    )


def entry_labels(key: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "davit-model-cache",
        "app.kubernetes.io/component": "model-fetch",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        ENTRY_LABEL: key,
    }


def _credentials(entry: ModelEntry) -> list[dict[str, Any]]:
    if entry.credentials_secret is None:
        return []
    keys = HF_CREDENTIALS if entry.scheme == "hf" else S3_CREDENTIALS
    return [
        {
            "name": key,
            "valueFrom": {
                "secretKeyRef": {
                    "name": entry.credentials_secret,
                    "key": key,
                    **({"optional": True} if optional else {}),
                }
            },
        }
        for key, optional in keys
    ]


def fetch_job(
    plan: Plan, entry: ModelEntry, owner: Owner, settings: FetchSettings
) -> dict[str, Any]:
    """The fetch Job of `entry`, placed like `plan`'s replicas."""
    args = [
        "fetch",
        "--source",
        entry.source,
        "--revision",
        entry.revision,
        "--cache",
        MODEL_STORE_DIR,
        "--host",
        "0.0.0.0",
        "--port",
        str(FETCH_PORT),
        "--result-file",
        TERMINATION_LOG,
    ]
    if entry.endpoint:
        args += ["--endpoint", entry.endpoint]
    if settings.max_bytes_per_second:
        args += ["--max-bytes-per-second", str(settings.max_bytes_per_second)]
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [
            {
                "name": FETCH_CONTAINER,
                "image": settings.image,
                "command": ["davit"],
                "args": args,
                "env": _credentials(entry),
                "ports": [{"name": "progress", "containerPort": FETCH_PORT, "protocol": "TCP"}],
                "resources": {
                    "requests": {"cpu": "250m", "memory": "256Mi"},
                    "limits": {"memory": "1Gi"},
                },
                "volumeMounts": [{"name": "model-store", "mountPath": MODEL_STORE_DIR}],
                "terminationMessagePath": TERMINATION_LOG,
                "terminationMessagePolicy": "File",
            }
        ],
        "volumes": [{"name": "model-store", "persistentVolumeClaim": {"claimName": entry.claim}}],
    }
    if plan.placement.node_selector:
        pod_spec["nodeSelector"] = plan.placement.node_selector
    if plan.placement.tolerations:
        pod_spec["tolerations"] = plan.placement.tolerations
    labels = entry_labels(entry.key)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": fetch_name(entry.key),
            "namespace": plan.namespace,
            "labels": labels,
            "ownerReferences": [{**owner_reference(owner), "controller": False}],
        },
        "spec": {
            "backoffLimit": FETCH_RETRIES,
            "activeDeadlineSeconds": FETCH_DEADLINE_SECONDS,
            "ttlSecondsAfterFinished": FETCH_TTL_SECONDS,
            "podFailurePolicy": {
                "rules": [
                    {
                        "action": "FailJob",
                        "onExitCodes": {
                            "containerName": FETCH_CONTAINER,
                            "operator": "In",
                            "values": [PERMANENT_EXIT],
                        },
                    }
                ]
            },
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def entry_record(namespace: str, key: str, result_json: str) -> dict[str, Any]:
    """The ConfigMap that records a complete entry (the fetcher's result). It has no owner: an
    entry outlives the services that asked for it, and a later one of the same revision finds
    it and fetches nothing."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": fetch_name(key), "namespace": namespace, "labels": entry_labels(key)},
        "data": {"result.json": result_json},
    }
