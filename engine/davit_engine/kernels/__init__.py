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
