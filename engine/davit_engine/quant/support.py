"""Where FP8 runs, and the flag values that ask for it.

FP8 (e4m3) needs NVIDIA compute capability 8.9 or newer (Ada, Hopper, Blackwell): their
conversion instructions and FP8 matrix units. On older NVIDIA GPUs and on ROCm the engine
refuses the flags at startup, naming the flag. On the CPU it stores FP8 (weights and KV cache)
and computes in the activation dtype (float32 by default) through the plain-torch paths: the
numbers match the GPU's up to summation order, which is what the quality tests rely on, but
nothing is faster.
"""

from __future__ import annotations

import torch

from davit_engine.layers.fp8 import FP8_DTYPE
from davit_engine.types import ParamError

FP8_MIN_CAPABILITY = (8, 9)


def is_fp8_kv(value: str) -> bool:
    return value in ("fp8", "fp8_e4m3")


def kv_cache_dtype_name(value: str) -> str:
    """The identity's spelling of a --kv-cache-dtype value: "auto" or "fp8" (both FP8 names
    are the same e4m3 format)."""
    return "fp8" if is_fp8_kv(value) else "auto"


def kv_storage_dtype(value: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for a --kv-cache-dtype value."""
    return FP8_DTYPE if is_fp8_kv(value) else model_dtype


def check_fp8_device(device: torch.device, flag: str, value: str) -> None:
    """Raise ParamError naming `flag` when FP8 cannot run on `device` (see the module)."""
    if device.type != "cuda":
        return
    # flag "model": the checkpoint itself is FP8, there is no flag to remove
    remedy = "serve an unquantized checkpoint of the model" if flag == "model" else f"remove {flag}"
    if torch.version.hip is not None:
        raise ParamError(
            flag,
            f"{value} is not implemented on ROCm by this engine version; {remedy} (or "
            "serve with engine type vllm)",
        )
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(index)
        raise ParamError(
            flag,
            f"{value} needs an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper, "
            f"Blackwell); {name} is {major}.{minor}: {remedy}",
        )
