"""Programmatic dependent launch (PDL) for the short kernels of a decode step.

A decode step at small batch is a chain of a few hundred kernels, most of them a few
microseconds long, and each boundary costs the launch of the next grid after the previous one
drained. Launched with PDL (sm_90 and newer), a kernel's programs may become resident while the
kernel before it finishes; each kernel here waits (`griddepcontrol.wait`) at its very first
instruction until the previous kernel completed and its writes are visible, so no value can
change, and then allows the kernel after it to start launching (`griddepcontrol.launch_dependents`).

`pdl_launch(device)` gives the launch options and the `USE_GDC` constexpr for a kernel on
`device`: on where the GPU supports it, off on the CPU, under Triton's interpreter, on older GPUs
and with `DAVIT_PDL=0`.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl

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


@functools.cache
def _capable(device_index: int) -> bool:
    major, _ = torch.cuda.get_device_capability(device_index)
    return major >= 9


def pdl_enabled(device: torch.device) -> bool:
    if not _HAVE_GDC or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get(PDL_ENV, "1") == "0":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch(device: torch.device) -> dict[str, Any]:
    """Keyword arguments for a kernel launch whose kernel starts with `gdc_enter(USE_GDC)`."""
    if pdl_enabled(device):
        return {"USE_GDC": True, "launch_pdl": True}
    return {"USE_GDC": False}
