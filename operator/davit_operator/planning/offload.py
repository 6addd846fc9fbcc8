"""KV offload (`features.kvCacheOffloading`): the engine flags, the disk tier's volume, the pod's
extra memory and each tier's capacity in tokens.

Both engine types take upstream's `--kv-offloading-size` (GiB of host memory) for the CPU tier;
the Davit engine's disk tier is `--kv-offload-disk-path`/`--kv-offload-disk-bytes`. What a
release implements is the catalog's `capabilities.kvOffloading`; a tier it lacks is refused
naming the field (upstream's own disk tier is reachable only through `--kv-transfer-config` and
has no size bound, so the catalog records vLLM releases with the CPU tier alone).
"""

from __future__ import annotations

from typing import Any

from davit_contract.kv_offload import disk_file_bytes
from davit_operator.api.spec import InferenceServiceSpec, positive_bytes
from davit_operator.catalog.loader import EngineInfo
from davit_operator.planning.errors import PlanError

OFFLOAD_DIR = "/var/cache/davit-kv"
OFFLOAD_VOLUME = "kv-offload"
# The engine keeps its block files within this share of disk.size: the rest absorbs the file
# system's own overhead and files being written, so an emptyDir never exceeds its sizeLimit
# (the kubelet evicts a pod that does).
DISK_SHARE = 0.9


def cpu_bytes(spec: InferenceServiceSpec) -> int:
    """Host memory of the CPU tier (0 without one)."""
    offloading = spec.features.kv_cache_offloading
    if offloading is None or offloading.cpu is None:
        return 0
    return positive_bytes(offloading.cpu.size, "features.kvCacheOffloading.cpu.size")


def disk_bytes(spec: InferenceServiceSpec) -> int:
    """Bytes of block files the engine may keep (0 without a disk tier)."""
    offloading = spec.features.kv_cache_offloading
    if offloading is None or offloading.disk is None:
        return 0
    size = positive_bytes(offloading.disk.size, "features.kvCacheOffloading.disk.size")
    return int(size * DISK_SHARE)


def offload_args(spec: InferenceServiceSpec, engine: EngineInfo) -> list[str]:
    """The engine flags for the spec's tiers; PlanError (UnsupportedByEngine) naming the tier's
    field when the spec's release does not implement it."""
    offloading = spec.features.kv_cache_offloading
    if offloading is None:
        return []
    release = next((r for r in engine.releases if r.version == spec.engine.version), None)
    implemented = release.capabilities.kv_offloading if release is not None else []
    for tier, wanted in (("cpu", offloading.cpu), ("disk", offloading.disk)):
        if wanted is not None and tier not in implemented:
            offered = f"it offers: {', '.join(implemented)}" if implemented else "it has none"
            raise PlanError(
                field=f"features.kvCacheOffloading.{tier}",
                value=wanted.size,
                reason="UnsupportedByEngine",
                condition="",
                message=f"{spec.engine.type} {spec.engine.version} has no {tier} tier for KV "
                f"offload ({offered}); remove features.kvCacheOffloading.{tier}",
            )
    args: list[str] = []
    if offloading.cpu is not None:
        args += ["--kv-offloading-size", repr(cpu_bytes(spec) / 2**30)]
        if spec.engine.type == "vllm":
            args += ["--kv-offloading-backend", "native"]
    if offloading.disk is not None:
        args += ["--kv-offload-disk-path", OFFLOAD_DIR]
        args += ["--kv-offload-disk-bytes", str(disk_bytes(spec))]
    return args


def offload_volume(spec: InferenceServiceSpec) -> dict[str, Any] | None:
    """The disk tier's pod volume: an emptyDir limited to disk.size, or the named claim."""
    offloading = spec.features.kv_cache_offloading
    if offloading is None or offloading.disk is None:
        return None
    disk = offloading.disk
    if disk.kind == "PersistentVolumeClaim":
        return {"name": OFFLOAD_VOLUME, "persistentVolumeClaim": {"claimName": disk.claim_name}}
    return {"name": OFFLOAD_VOLUME, "emptyDir": {"sizeLimit": str(disk.size)}}


def offload_mount(spec: InferenceServiceSpec) -> dict[str, Any] | None:
    if offload_volume(spec) is None:
        return None
    return {"name": OFFLOAD_VOLUME, "mountPath": OFFLOAD_DIR}


def tier_tokens(
    spec: InferenceServiceSpec, block_bytes: int, block_size: int
) -> tuple[int | None, int | None]:
    """Tokens the CPU and the disk tier hold with KV blocks of `block_bytes` (None: no tier)."""
    cpu, disk = cpu_bytes(spec), disk_bytes(spec)
    return (
        cpu // block_bytes * block_size if cpu else None,
        disk // disk_file_bytes(block_bytes) * block_size if disk else None,
    )
