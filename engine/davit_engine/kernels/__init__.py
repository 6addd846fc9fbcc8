"""Triton kernels of the engine, each next to a plain-torch reference that the tests compare with.

Modules here import `triton` at import time; import them only on a path that runs kernels
(runner V2, the Triton attention backend, tests). On CPU the kernels run under Triton's
interpreter (`TRITON_INTERPRET=1`), which the tests use at tiny sizes.
"""

from __future__ import annotations

import os


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (`TRITON_INTERPRET=1`): no inline
    assembly, no launch options of the GPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"
