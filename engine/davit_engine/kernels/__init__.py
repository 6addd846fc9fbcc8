"""Triton kernels of the engine, each next to a plain-torch reference that the tests compare with.

Modules here import `triton` at import time; import them only on a path that runs kernels
(runner V2, the Triton attention backend, tests). On CPU the kernels run under Triton's
interpreter (`TRITON_INTERPRET=1`), which the tests use at tiny sizes.
"""

from __future__ import annotations

import functools
import os

import torch


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (`TRITON_INTERPRET=1`): no inline
    assembly, no launch options of the GPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessor count; 4 off a GPU (the interpreter: small, so that the
    tests exercise the paths that many programs per multiprocessor take)."""
    if device.type != "cuda":
        return 4
    return _cuda_multiprocessors(device.index)


def capability(device: torch.device) -> tuple[int, int]:
    """The CUDA device's compute capability, decided once per device (launches are hot
    paths); (0, 0) off a GPU."""
    if device.type != "cuda":
        return (0, 0)
    return _cuda_capability(device.index)


@functools.cache
def _cuda_capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(
        index if index is not None else torch.cuda.current_device()
    )


@functools.cache
def _cuda_multiprocessors(index: int | None) -> int:
    return torch.cuda.get_device_properties(
        index if index is not None else torch.cuda.current_device()
    ).multi_processor_count


# Counter arrays replaced by larger ones (`zeroed_counters`): CUDA graphs captured with them
# still address them, so they are kept for the life of the process.
_RETIRED_COUNTERS: list[torch.Tensor] = []


def zeroed_counters(
    store: dict[tuple[str, int | None], torch.Tensor],
    device: torch.device,
    needed: int,
    minimum: int,
) -> torch.Tensor | None:
    """`device`'s int32 ticket counters in `store`, at least `needed` of them: the counts that
    kernels whose last program to arrive finishes the work take (each launch leaves them at
    zero, so launches one after another on a stream, captured in CUDA graphs or not, share
    one array a device). Made zeroed, or grown to a power of two of at least `minimum`,
    outside a CUDA graph capture; None where that would have to happen inside one (an
    allocation made in a capture belongs to the graph's pool; the caller then runs its
    unfused kernels, and the V2 runner's eager warm-up makes them before it captures)."""
    key = (device.type, device.index)
    counters = store.get(key)
    if counters is not None and counters.numel() >= needed:
        return counters
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if counters is not None:
        _RETIRED_COUNTERS.append(counters)
    size = max(minimum, 1 << max(needed - 1, 0).bit_length())
    counters = torch.zeros(size, dtype=torch.int32, device=device)
    store[key] = counters
    return counters
