"""Startup memory profiling and the profile it produces.

`profile` (plain data, no torch) is what the operator reads; `profiler` measures a runner.
"""

from davit_contract.profile import (
    SCHEMA_VERSION,
    MemoryBreakdown,
    MemoryProfile,
    ProfileFormatError,
    ProfileIdentity,
)

__all__ = [
    "SCHEMA_VERSION",
    "MemoryBreakdown",
    "MemoryProfile",
    "ProfileFormatError",
    "ProfileIdentity",
]
