"""The `InferenceService` status, as the operator writes it.

kstatus readers (Argo CD, Flux, `kubectl wait`) need `observedGeneration` and the conditions
`Ready`, `Reconciling` and `Stalled`; the domain conditions `ImageResolved` and `RunnerSelected`
explain the two decisions the operator takes for the user. Printer columns read the flat summary
fields (`engine`, `runner`, `accelerator`, `replicaSummary`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from davit_operator.api.rollout import RevisionRecord, RolloutStatus
from davit_operator.api.schema import CrdModel

ConditionStatus = Literal["True", "False", "Unknown"]

READY = "Ready"
RECONCILING = "Reconciling"
STALLED = "Stalled"
IMAGE_RESOLVED = "ImageResolved"
RUNNER_SELECTED = "RunnerSelected"
SCHEDULABLE = "Schedulable"
MEMORY_PLANNED = "MemoryPlanned"
MODEL_READY = "ModelReady"
# Present (True) only while the pods run an image the catalog cannot vouch for: engine.version
# newer than its releases, or engine.image overriding a variant never published (planning/image.py).
UNCATALOGUED = "Uncatalogued"


class Condition(CrdModel):
    type: str = Field(max_length=64, description="Condition type (Ready, Stalled, ...).")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(max_length=128, description="CamelCase reason for the last transition.")
    message: str = Field(default="", max_length=4096, description="Human-readable explanation.")
    last_transition_time: str = Field(
        description="RFC 3339 time the status last changed.", max_length=64
    )
    observed_generation: int = Field(
        default=0, ge=0, description="metadata.generation this condition was computed from."
    )


class ArtifactStatus(CrdModel):
    image: str = Field(description="Full image reference used by the pods.")
    repository: str = Field(description="Image repository.")
    tag: str | None = Field(default=None, description="Exact image tag, when known.")
    digest: str | None = Field(default=None, description="sha256 digest, when known.")
    pinned: bool = Field(description="True when the pods reference the image by digest.")
    engine_type: str = Field(description="davit or vllm.")
    engine_version: str = Field(description="Engine release (the catalog's version).")
    release_title: str | None = Field(
        default=None, description="The release's published title, when it differs from its tag."
    )
    variant: str = Field(description="Image variant (cuda13.0, cuda12.9, rocm, cpu, xpu).")
    catalog_version: str = Field(description="Catalog version the image was resolved from.")
    source: Literal["catalog", "override"] = Field(
        description="Whether the image came from the catalog or from engine.image."
    )


class RunnerStatus(CrdModel):
    name: Literal["v1", "v2"] = Field(description="Selected model runner.")
    reason: str = Field(description="Why this runner was selected.")


class MemoryPlanStatus(CrdModel):
    source: Literal["explicit", "profile", "estimate", "pending"] = Field(
        description=(
            "Where the KV-cache size comes from: limits.kvCacheMemoryBytes (explicit), a "
            "measured engine profile (profile), the model shape (estimate), or a profiling Job "
            "still running (pending)."
        )
    )
    identity_hash: str = Field(
        max_length=64, description="Hash of what the profile depends on (labels the profile)."
    )
    message: str = Field(default="", max_length=1024, description="How the numbers were made.")
    profile: str | None = Field(default=None, description="ConfigMap holding the profile.")
    kv_cache_bytes: int | None = Field(default=None, description="KV-cache bytes per GPU.")
    weights_bytes: int | None = Field(default=None, description="Weight bytes per GPU.")
    activation_bytes: int | None = Field(
        default=None, description="Peak activations incl. the sampler, bytes per GPU."
    )
    cuda_graph_bytes: int | None = Field(default=None, description="CUDA-graph pool bytes.")
    runner_buffer_bytes: int | None = Field(
        default=None, description="Runner's persistent buffers (request state, inputs)."
    )
    non_torch_bytes: int | None = Field(
        default=None, description="Memory outside torch's allocator (context, workspaces)."
    )
    token_capacity: int | None = Field(default=None, description="Tokens the KV cache holds.")
    max_model_len: int | None = Field(default=None, description="maxModelLen the plan assumes.")
    max_concurrency: str | None = Field(
        default=None, description="Full-length (maxModelLen) sequences the KV cache holds."
    )
    cpu_offload_token_capacity: int | None = Field(
        default=None,
        description="Tokens the KV offload CPU tier holds (features.kvCacheOffloading).",
    )
    disk_offload_token_capacity: int | None = Field(
        default=None,
        description="Tokens the KV offload disk tier holds (features.kvCacheOffloading).",
    )


class ModelStatus(CrdModel):
    source: str = Field(description="model.source.")
    revision: str | None = Field(default=None, description="model.revision.")
    state: Literal["Present", "Fetching", "Failed", "Mounted", "Unmanaged", "NotNeeded"] = Field(
        description=(
            "Present: in the model cache; Fetching: the fetch Job runs (replicas and profiling "
            "wait); Failed: the fetch failed (see the ModelReady condition); Mounted: a pvc:// "
            "source, mounted as it is; Unmanaged: model.cache.emptyDir, the pods fetch it "
            "themselves; NotNeeded: random weights."
        )
    )
    cache: str | None = Field(default=None, description="The model cache claim.")
    entry: str | None = Field(
        default=None, description="The cache entry: fetch Job and record ConfigMap name."
    )
    commit: str | None = Field(default=None, description="The commit the revision resolved to.")
    bytes_done: int | None = Field(default=None, description="Bytes in the cache so far.")
    bytes_total: int | None = Field(default=None, description="Bytes the engine needs.")
    files: int | None = Field(default=None, description="Files the engine needs.")


class InferenceServiceStatus(CrdModel):
    observed_generation: int | None = Field(
        default=None, description="metadata.generation the status describes."
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        description=(
            "kstatus conditions plus ImageResolved, RunnerSelected, Schedulable and MemoryPlanned."
        ),
    )
    artifact: ArtifactStatus | None = Field(
        default=None, description="The exact engine artifact the pods run."
    )
    runner: RunnerStatus | None = Field(default=None, description="Selected model runner.")
    memory_plan: MemoryPlanStatus | None = Field(
        default=None, description="KV-cache sizing: source, components, capacity."
    )
    engine: str | None = Field(default=None, description="Summary: TYPE VERSION (printer column).")
    accelerator: str | None = Field(
        default=None, description="Summary: COUNT x PRODUCT per replica (printer column)."
    )
    engine_args: list[str] = Field(
        default_factory=list,
        description="Effective engine command line: the command followed by its arguments.",
    )
    desired_replicas: int | None = Field(
        default=None,
        description="Replicas the operator runs: spec.replicas, or with spec.autoscaling the "
        "count last set through the scale subresource (kept when a re-apply resets "
        "spec.replicas).",
    )
    ready_replicas: int | None = Field(default=None, description="Replicas passing readiness.")
    updated_replicas: int | None = Field(
        default=None, description="Replicas running the current pod template."
    )
    replica_summary: str | None = Field(default=None, description="READY/DESIRED (printer column).")
    replicas: int | None = Field(
        default=None,
        description="Engine pods of every rollout track (the scale subresource's status).",
    )
    selector: str | None = Field(
        default=None,
        description="Label selector of every engine pod (the scale subresource's selector).",
    )
    url: str | None = Field(
        default=None, description="In-cluster base URL of the OpenAI-compatible API."
    )
    model: ModelStatus | None = Field(
        default=None, description="Where the model of the spec stands: fetched, mounted, failed."
    )
    rollout: RolloutStatus | None = Field(
        default=None, description="The rollout of the latest spec change."
    )
    revisions: list[RevisionRecord] = Field(
        default_factory=list,
        max_length=10,
        description="Revision history, newest last: hash, image, arguments, when, outcome.",
    )
