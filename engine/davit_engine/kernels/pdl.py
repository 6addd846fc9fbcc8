"""Programmatic dependent launch (PDL) for the short kernels of a decode step.

A decode step at small batch is a chain of a few hundred kernels, most of them a few
microseconds long, and each boundary costs the launch of the next grid after the previous one
drained. Launched with PDL (sm_90 and newer), a kernel's programs may become resident while the
kernel before it finishes; each kernel here waits (`griddepcontrol.wait`) at its very first
instruction until the previous kernel completed and its writes are visible, so no value can
change, and then allows the kernel after it to start launching (`griddepcontrol.launch_dependents`).

What a kernel may read before its wait: whatever the kernel just before it cannot have
written. A kernel here lets the next one launch only after it passed its own wait, so when a
kernel's programs start, every kernel before the one just before it has completed and its
writes are visible (a kernel launched without PDL, a library kernel, lets the next one launch
only when it completes). So constants (weights, tables) and the step's inputs written before
the layers run (block tables, lengths, slots, cos/sin rows) can be read early, and the
previous kernel's outputs only after the wait. Every program waits, even one with no work:
one that exited without waiting could let the kernel after it start before the kernel before
it completed. The one-row FP8 products (`fp8_gemv`), the attention and the rotary kernel have
such early loads, each behind a switch.

`pdl_launch(device)` gives the launch options and the `USE_GDC` constexpr for a kernel on
`device`: on where the GPU supports it, off on the CPU, under Triton's interpreter, on older GPUs
and with `DAVIT_PDL=0`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
import triton
import triton.language as tl

from davit_engine.kernels import interpreted

PDL_ENV = "DAVIT_PDL"

try:  # present in the Triton releases the engine supports on Hopper; absent: PDL stays off
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAVE_GDC = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    _HAVE_GDC = False


@triton.jit
def gdc_enter(USE_GDC: tl.constexpr):  # type: ignore[no-untyped-def]
    """First statement of a PDL-launched kernel: wait for the previous kernel, then let the
    next one start launching."""
    if USE_GDC:
        gdc_wait()
        gdc_launch_dependents()


_OFF = {"USE_GDC": False}


@functools.cache
def _options(device_type: str, device_index: int | None) -> Mapping[str, Any]:
    """Decided once per device (a kernel launch is a hot path); `refresh()` after changing
    `DAVIT_PDL` in a running process."""
    enabled = (
        _HAVE_GDC
        and device_type == "cuda"
        and not interpreted()
        and os.environ.get(PDL_ENV, "1") != "0"
    )
    if enabled:
        index = device_index if device_index is not None else torch.cuda.current_device()
        enabled = torch.cuda.get_device_capability(index)[0] >= 9
    return MappingProxyType({"USE_GDC": True, "launch_pdl": True} if enabled else _OFF)


def refresh() -> None:
    """Forget the per-device decisions (they are read again from the environment)."""
    _options.cache_clear()


def pdl_enabled(device: torch.device) -> bool:
    return bool(_options(device.type, device.index)["USE_GDC"])


def pdl_launch(device: torch.device) -> Mapping[str, Any]:
    """Keyword arguments for a kernel launch whose kernel starts with `gdc_enter(USE_GDC)`."""
    return _options(device.type, device.index)
