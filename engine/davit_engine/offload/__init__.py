"""KV-cache offload: tiers of host memory and disk below the GPU prefix cache.

`build_tiers(config, runner, num_gpu_blocks)` builds them from `--kv-offloading-size` (the CPU
tier, GiB) and `--kv-offload-disk-path`/`--kv-offload-disk-bytes` (the disk tier) once the
runner's KV cache exists; the scheduler drives them through `core.kv_tiers.LowerTiers` and the
step pipeline through `OffloadingRunner`. docs/kv-offload.md describes the design.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from davit_contract.kv_offload import disk_file_bytes
from davit_engine.config import EngineConfig
from davit_engine.offload.block_image import BlockImage
from davit_engine.offload.disk import DiskIndex
from davit_engine.offload.host_pool import HostPool
from davit_engine.offload.identity import identity_digest, kv_identity
from davit_engine.offload.mover import CudaMover, Mover, chunk_blocks, staging_blocks
from davit_engine.offload.tiers import KvTiers

logger = logging.getLogger(__name__)

# The offload facts the memory profile carries (integers; see davit_contract.profile).
PROFILE_OFFLOAD_KEYS = (
    "cpu_bytes",
    "cpu_blocks",
    "cpu_token_capacity",
    "disk_bytes",
    "disk_blocks",
    "disk_token_capacity",
    "gpu_staging_bytes",
    "host_bounce_blocks",
)

# Host slots beyond the CPU tier's blocks, for disk reads and writes under way: a full-length
# sequence's blocks, within these bounds.
MIN_BOUNCE_BLOCKS = 64
MAX_BOUNCE_BLOCKS = 2048


def staging_chunk(config: EngineConfig, device: torch.device, num_blocks: int) -> int:
    """Blocks per copy batch for a cache of `num_blocks`; `mover.staging_blocks(chunk)` of
    them are the GPU staging buffers, taken from the KV cache (none on the CPU)."""
    if not config.has_kv_offload:
        return 0
    return chunk_blocks(num_blocks)


def build_tiers(
    config: EngineConfig, runner: Any, max_model_len: int, chunk: int
) -> KvTiers | None:
    """The tiers over `runner`'s KV cache (a runner with `kv_caches`, and a draft model's),
    or None without offload flags; `chunk` from `staging_chunk`."""
    if not config.has_kv_offload:
        return None
    groups = [runner.kv_caches]
    models = [runner.model]
    draft = getattr(runner, "draft", None)
    if draft is not None and draft.kv_caches:
        groups.append(draft.kv_caches)
        models.append(draft.model)
    image = BlockImage(groups)
    device: torch.device = runner.device
    identity = kv_identity(
        config,
        models,
        device,
        runner.dtype,
        runner.loaded.kv_cache_dtype,
        image.layouts,
        runner.kv_dtype,
    )
    digest = identity_digest(identity)
    block_bytes = image.block_bytes
    cpu_blocks = 0
    if config.kv_offloading_size is not None:
        cpu_blocks = int(config.kv_offloading_size * 2**30) // block_bytes
    bounce = min(MAX_BOUNCE_BLOCKS, max(MIN_BOUNCE_BLOCKS, -(-max_model_len // config.block_size)))
    pool = HostPool(cpu_blocks + bounce, block_bytes, pin=device.type == "cuda")
    mover = CudaMover(image, pool, chunk) if device.type == "cuda" else Mover(image, pool, chunk)
    disk = None
    if config.kv_offload_disk_path is not None:
        assert config.kv_offload_disk_bytes is not None
        disk = DiskIndex(
            config.kv_offload_disk_path,
            identity,
            digest,
            config.kv_offload_disk_bytes,
            disk_file_bytes(block_bytes),
        )
    tiers = KvTiers(mover, pool, config.block_size, cpu_blocks, disk)
    tiers.info = offload_info(config, tiers, digest, bounce)
    logger.info("KV offload: %s", tiers.info)
    return tiers


def offload_info(
    config: EngineConfig, tiers: KvTiers, digest: bytes, bounce: int
) -> dict[str, Any]:
    """What the startup log, the engine info route and the memory profile report."""
    bs = config.block_size
    disk = tiers.disk
    return {
        "block_bytes": tiers.block_bytes,
        "identity": digest.hex(),
        "cpu_bytes": tiers.cpu_blocks * tiers.block_bytes,
        "cpu_blocks": tiers.cpu_blocks,
        "cpu_token_capacity": tiers.cpu_blocks * bs,
        "host_bounce_blocks": bounce,
        "host_pinned": tiers.pool.is_pinned,
        "disk_path": config.kv_offload_disk_path,
        "disk_bytes": disk.capacity_bytes if disk else 0,
        "disk_blocks": disk.capacity_blocks if disk else 0,
        "disk_token_capacity": disk.capacity_blocks * bs if disk else 0,
        "disk_blocks_found": disk.num_blocks if disk else 0,
        "gpu_staging_bytes": tiers.mover.staging_bytes,
        "backend": config.kv_offloading_backend,
    }


__all__ = ["PROFILE_OFFLOAD_KEYS", "KvTiers", "build_tiers", "staging_blocks", "staging_chunk"]
