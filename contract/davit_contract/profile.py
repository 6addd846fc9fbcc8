"""The memory profile: what the engine measured at startup and for which configuration.

Plain dataclasses and JSON, no torch: the operator reads the profiles
that profiling Jobs write into their termination message, the engine writes them.

A profile has two halves. `ProfileIdentity` names everything the numbers depend on (image,
model, dtypes, device, runner, limits); two engines with equal identities get equal numbers, so
one measurement serves every replica. `MemoryBreakdown` holds the numbers:

    kv_cache_bytes = budget_bytes - weights - activation_peak - cuda_graphs
                     - runner_buffers - non_torch
    budget_bytes   = total_bytes * gpu_memory_utilization
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, Literal

SCHEMA_VERSION = 1
PROFILE_KIND = "DavitMemoryProfile"

KvSource = Literal["profile", "explicit", "override"]


class ProfileFormatError(ValueError):
    """A document that is not a memory profile this code can read (names what is wrong)."""


@dataclass(frozen=True)
class ProfileIdentity:
    """What the measured numbers depend on. `hash()` keys stored profiles.

    Empty strings mean "not known here" (no image digest outside a container, no GPU on a CPU
    run); they still take part in the hash, so a known and an unknown value never match.
    """

    engine_version: str
    image_digest: str
    model: str
    model_revision: str
    dtype: str
    device: str  # "cuda" or "cpu"
    gpu_product: str
    device_memory_bytes: int
    driver_version: str
    cuda_version: str
    runner: str
    tensor_parallel_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    gpu_memory_utilization: float
    cuda_graphs: bool
    # Added within schema version 1 (FP8): "fp8" for an FP8 KV cache, "fp8" for FP8
    # projection weights. Documents written before they existed lack them and read as the
    # defaults, which is what those engines ran.
    kv_cache_dtype: str = "auto"
    quantization: str = "none"
    # Added within schema version 1: the --lm-head-quantization value the engine loaded with,
    # "fp8" (an FP8 LM head) or "int8" (an int8 LM head); "none": the model dtype's.
    lm_head_quantization: str = "none"
    # Added within schema version 1: "native" where a block-wise FP8 checkpoint is served with
    # its own scales (--fp8-block-scales native: a scale per row and group, more weight bytes).
    fp8_block_scales: str = "channel"

    def hash(self) -> str:
        """A short stable digest of every field (sorted JSON, sha256, 16 hex digits).

        Fields added within a schema version are left out while they hold their defaults, so
        every identity written before they existed keeps its hash (and its stored profile).
        """
        data = asdict(self)
        for name, default in _LATER_DEFAULTS.items():
            if data[name] == default:
                del data[name]
        text = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


# ProfileIdentity fields added after schema version 1 was first written, with their defaults.
_LATER_DEFAULTS: dict[str, object] = {
    "kv_cache_dtype": "auto",
    "quantization": "none",
    "lm_head_quantization": "none",
    "fp8_block_scales": "channel",
}


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per component, and what they leave for the KV cache.

    `method` says how the numbers were taken: "cuda" (torch's allocator statistics and the
    driver's free memory) or "cpu-rss" (parameter bytes and the process's resident set).
    """

    method: str
    total_bytes: int
    budget_bytes: int
    weights_bytes: int
    activation_peak_bytes: int
    cuda_graph_bytes: int
    runner_buffer_bytes: int
    non_torch_bytes: int
    kv_cache_bytes: int
    block_bytes: int
    num_blocks: int
    token_capacity: int
    max_concurrency: float  # full-length (max_model_len) sequences the KV cache holds
    kv_source: KvSource
    cuda_graph_sizes: tuple[int, ...] = ()

    @property
    def predicted_peak_bytes(self) -> int:
        """Everything the engine holds while serving at its largest batch."""
        return (
            self.weights_bytes
            + self.activation_peak_bytes
            + self.cuda_graph_bytes
            + self.runner_buffer_bytes
            + self.non_torch_bytes
            + self.num_blocks * self.block_bytes
        )


@dataclass(frozen=True)
class MemoryProfile:
    """`offload` (optional, added within schema version 1): the KV offload tiers' sizes
    (`cpu_bytes`, `cpu_blocks`, `cpu_token_capacity`, `disk_bytes`, `disk_blocks`,
    `disk_token_capacity`, `gpu_staging_bytes`, `host_bounce_blocks`); their GPU staging
    buffers are part of `kv_cache_bytes`, so `num_blocks` counts them too."""

    identity: ProfileIdentity
    memory: MemoryBreakdown
    schema_version: int = SCHEMA_VERSION
    offload: dict[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        memory = asdict(self.memory)
        memory["cuda_graph_sizes"] = list(self.memory.cuda_graph_sizes)
        data: dict[str, Any] = {
            "kind": PROFILE_KIND,
            "schemaVersion": self.schema_version,
            "identityHash": self.identity.hash(),
            "identity": asdict(self.identity),
            "memory": memory,
        }
        if self.offload is not None:
            data["offload"] = dict(self.offload)
        return data

    def to_json(self) -> str:
        """One line of sorted JSON (a termination message holds at most 4096 bytes)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Any) -> MemoryProfile:
        if not isinstance(data, dict):
            raise ProfileFormatError(f"a profile is a JSON object, got {type(data).__name__}")
        if data.get("kind") != PROFILE_KIND:
            raise ProfileFormatError(f"kind must be {PROFILE_KIND!r}, got {data.get('kind')!r}")
        version = data.get("schemaVersion")
        if version != SCHEMA_VERSION:
            raise ProfileFormatError(
                f"schemaVersion {version!r} is not supported (this code reads {SCHEMA_VERSION})"
            )
        identity = _build(ProfileIdentity, data.get("identity"), "identity")
        raw_memory = data.get("memory")
        if not isinstance(raw_memory, dict):
            raise ProfileFormatError("memory must be an object")
        memory_data = dict(raw_memory)
        memory_data["cuda_graph_sizes"] = tuple(memory_data.get("cuda_graph_sizes") or ())
        memory = _build(MemoryBreakdown, memory_data, "memory")
        offload = data.get("offload")
        if offload is not None and (
            not isinstance(offload, dict)
            or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                for k, v in offload.items()
            )
        ):
            raise ProfileFormatError("offload must be an object of integers")
        profile = cls(identity=identity, memory=memory, offload=offload)
        stated = data.get("identityHash")
        if stated is not None and stated != identity.hash():
            raise ProfileFormatError(
                f"identityHash {stated!r} does not match the identity ({identity.hash()})"
            )
        return profile

    @classmethod
    def from_json(cls, text: str) -> MemoryProfile:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileFormatError(f"not JSON: {exc}") from None
        return cls.from_dict(data)


def _build(kind: Any, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ProfileFormatError(f"{where} must be an object")
    names = {f.name: f for f in fields(kind)}
    missing = [
        n
        for n, f in names.items()
        if n not in data and f.default is MISSING and f.default_factory is MISSING
    ]
    if missing:
        raise ProfileFormatError(f"{where} lacks {', '.join(sorted(missing))}")
    values: dict[str, Any] = {}
    for name, f in names.items():
        if name not in data:
            continue
        value = data[name]
        expected = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        if expected == "int" and (not isinstance(value, int) or isinstance(value, bool)):
            raise ProfileFormatError(f"{where}.{name} must be an integer, got {value!r}")
        if expected == "str" and not isinstance(value, str):
            raise ProfileFormatError(f"{where}.{name} must be a string, got {value!r}")
        if expected == "float" and not isinstance(value, int | float):
            raise ProfileFormatError(f"{where}.{name} must be a number, got {value!r}")
        values[name] = float(value) if expected == "float" else value
    return kind(**values)
