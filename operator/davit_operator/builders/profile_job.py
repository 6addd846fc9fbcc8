"""The memory-profiling Job and the ConfigMap that keeps its result.

The Job runs the replicas' own image, command and arguments on the same accelerator class
(node selector, tolerations, affinity, resources), plus `--profile-only`: the engine measures
memory, writes its profile (the contract's memory profile document) to the termination log and
exits. One Job per profile identity; its name and label carry the identity hash.

The ConfigMap has no owner: a profile outlives the InferenceService that asked for it, so a
later InferenceService with the same identity starts without a Job.
"""

from __future__ import annotations

from typing import Any

from davit_operator.api.identity import GROUP
from davit_operator.builders.metadata import MANAGED_BY, Owner, owner_reference
from davit_operator.builders.pod import (
    engine_volume_mounts,
    engine_volumes,
    model_env,
    scheduling,
)
from davit_operator.planning.memory import KV_FLAG
from davit_operator.planning.plan import Plan

PROFILE_IDENTITY_LABEL = f"{GROUP}/profile-identity"
PROFILE_KEY = "profile.json"
IDENTITY_KEY = "identity.json"
IMAGE_DIGEST_ENV = "DAVIT_IMAGE_DIGEST"
MODEL_REVISION_ENV = "DAVIT_MODEL_REVISION"
# Loading large weights and capturing every CUDA graph takes minutes, not hours.
PROFILE_DEADLINE_SECONDS = 3600
PROFILE_TTL_SECONDS = 24 * 3600


def profile_name(identity_hash: str) -> str:
    """Name of the Job and of the ConfigMap for one identity."""
    return f"davit-profile-{identity_hash}"


def profile_labels(identity_hash: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "davit-engine",
        "app.kubernetes.io/component": "memory-profile",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        PROFILE_IDENTITY_LABEL: identity_hash,
    }


def profile_args(args: list[str]) -> list[str]:
    """The replicas' engine arguments without an explicit KV size, plus `--profile-only`."""
    out = list(args)
    if KV_FLAG in out:
        i = out.index(KV_FLAG)
        del out[i : i + 2]
    return [*out, "--profile-only"]


def profile_job(plan: Plan, owner: Owner, identity_hash: str) -> dict[str, Any]:
    """The profiling Job for `plan` (whose image and placement the replicas will use)."""
    env = model_env(plan)
    env.append({"name": IMAGE_DIGEST_ENV, "value": plan.image.digest or plan.image.reference})
    env.append({"name": MODEL_REVISION_ENV, "value": plan.spec.model.revision or ""})
    mounts = engine_volume_mounts(plan)
    volumes = engine_volumes(plan)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [
            {
                "name": "engine",
                "image": plan.image.reference,
                "command": plan.invocation.command,
                "args": profile_args(plan.invocation.args),
                "env": env,
                "resources": plan.placement.resources,
                "volumeMounts": mounts,
                # The engine writes the profile there; the kubelet copies it into the pod's
                # status (containerStatuses[].state.terminated.message).
                "terminationMessagePath": "/dev/termination-log",
                "terminationMessagePolicy": "File",
            }
        ],
        "volumes": volumes,
        **scheduling(plan),
    }
    name = profile_name(identity_hash)
    labels = profile_labels(identity_hash)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": plan.namespace,
            "labels": labels,
            "ownerReferences": [{**owner_reference(owner), "controller": False}],
        },
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": PROFILE_DEADLINE_SECONDS,
            "ttlSecondsAfterFinished": PROFILE_TTL_SECONDS,
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def profile_config_map(
    namespace: str, identity_hash: str, profile_json: str, identity_json: str
) -> dict[str, Any]:
    """The stored profile: the engine's JSON as measured, and the operator's identity."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": profile_name(identity_hash),
            "namespace": namespace,
            "labels": profile_labels(identity_hash),
        },
        "data": {PROFILE_KEY: profile_json, IDENTITY_KEY: identity_json},
    }
