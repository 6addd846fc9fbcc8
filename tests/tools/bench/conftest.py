"""Fixtures for the benchmark tools' tests, which drive the engine on the CPU: the process
settings the engine's own tests use (see tests/engine/conftest.py, whose fixtures do not reach
this folder) and the reference model's GGUF."""

from __future__ import annotations

import os

# Shared cores: OpenMP's default spin-waiting slows multi-threaded torch ops by tens of times.
# Only effective before torch is loaded.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path

import pytest
import torch

# Triton's interpreter must be chosen before any kernel module is imported, hence here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.support import reference_gguf


@pytest.fixture(autouse=True, scope="session")
def _cpu_threads() -> None:
    # Two cores shared with other work: more threads only add contention.
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the reference GGUF."""
    return reference_gguf()
