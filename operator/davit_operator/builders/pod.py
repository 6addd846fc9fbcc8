"""Pod parts the engine Deployment and the profiling Job share: volumes, scheduling and the
serving container's environment."""

from __future__ import annotations

from typing import Any

from davit_operator.api.spec import InferenceServiceSpec
from davit_operator.planning.args import MODEL_CACHE_DIR, MODEL_STORE_DIR
from davit_operator.planning.offload import offload_mount, offload_volume
from davit_operator.planning.plan import Plan

# The variable both engine types read their API key from.
API_KEY_ENV = "VLLM_API_KEY"
MODEL_STORE_VOLUME = "model-store"
FETCHED_SCHEMES = ("hf", "s3")


def model_store_claim(spec: InferenceServiceSpec) -> str | None:
    """The model cache claim the replicas mount, for an hf:// or s3:// source that uses the
    cache (the operator has filled in its default claim before planning)."""
    if spec.model.source.partition("://")[0] not in FETCHED_SCHEMES:
        return None
    return spec.model.cache.claim_name


def model_env(plan: Plan) -> list[dict[str, Any]]:
    """The planned variables, plus the model cache's: the hub cache on the read-only claim and
    offline mode, so neither engine type ever downloads (the typed cache wins over pod.env)."""
    env = list(plan.invocation.env)
    if model_store_claim(plan.spec) is None:
        return env
    ours = [
        {"name": "HF_HUB_CACHE", "value": f"{MODEL_STORE_DIR}/hf"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
    ]
    names = {entry["name"] for entry in ours}
    return [entry for entry in env if entry.get("name") not in names] + ours


def serving_env(plan: Plan) -> list[dict[str, Any]]:
    """The serving container's environment: the planned variables and the model cache's
    (`model_env`) and, with
    `engine.apiKeySecretRef`, the API key taken from the Secret by reference (the key's value
    never appears in the pod spec). The typed field wins over a same-named `pod.env` entry."""
    env = model_env(plan)
    ref = plan.spec.engine.api_key_secret_ref
    if ref is None:
        return env
    env = [entry for entry in env if entry.get("name") != API_KEY_ENV]
    env.append(
        {
            "name": API_KEY_ENV,
            "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}},
        }
    )
    return env


def engine_volume_mounts(plan: Plan) -> list[dict[str, Any]]:
    """The engine container's mounts: model cache, shared memory, read-only model volumes,
    the KV offload disk tier."""
    mounts: list[dict[str, Any]] = [
        {"name": "model-cache", "mountPath": MODEL_CACHE_DIR},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    if model_store_claim(plan.spec) is not None:
        mounts.append({"name": MODEL_STORE_VOLUME, "mountPath": MODEL_STORE_DIR, "readOnly": True})
    mounts += [
        {"name": m.volume_name, "mountPath": m.mount_path, "readOnly": True}
        for m in plan.invocation.model_mounts
    ]
    offload = offload_mount(plan.spec)
    if offload is not None:
        mounts.append(offload)
    return mounts


def engine_volumes(plan: Plan) -> list[dict[str, Any]]:
    """The pod volumes behind `engine_volume_mounts`."""
    volumes: list[dict[str, Any]] = [
        {"name": "model-cache", "emptyDir": {}},
        # Tensor-parallel workers exchange tensors through shared memory.
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]
    claim = model_store_claim(plan.spec)
    if claim is not None:
        volumes.append(
            {
                "name": MODEL_STORE_VOLUME,
                "persistentVolumeClaim": {"claimName": claim, "readOnly": True},
            }
        )
    volumes += [
        {
            "name": m.volume_name,
            "persistentVolumeClaim": {"claimName": m.claim_name, "readOnly": True},
        }
        for m in plan.invocation.model_mounts
    ]
    offload = offload_volume(plan.spec)
    if offload is not None:
        volumes.append(offload)  # the KV offload disk tier (read-write)
    return volumes


def scheduling(plan: Plan) -> dict[str, Any]:
    """The pod spec's node selector, tolerations, affinity and service account, where set."""
    fields: dict[str, Any] = {}
    if plan.placement.node_selector:
        fields["nodeSelector"] = plan.placement.node_selector
    if plan.placement.tolerations:
        fields["tolerations"] = plan.placement.tolerations
    if plan.placement.affinity:
        fields["affinity"] = plan.placement.affinity
    if plan.spec.pod.service_account_name:
        fields["serviceAccountName"] = plan.spec.pod.service_account_name
    return fields
