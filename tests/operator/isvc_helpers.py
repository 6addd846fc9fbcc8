"""Spec builders shared by the operator's unit tests."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from davit_operator.api.spec import InferenceServiceSpec

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES_DIR = REPO_ROOT / "examples"

BASE: dict[str, Any] = {
    "model": {"source": "hf://Qwen/Qwen3-8B", "revision": "main"},
    "engine": {"type": "davit", "version": "0.1.0"},
    "accelerator": {"vendor": "nvidia", "product": "NVIDIA-H200"},
}


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `overrides` into a copy of `base` (None deletes a key)."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def spec_dict(**overrides: Any) -> dict[str, Any]:
    return merge(BASE, overrides)


def make_spec(**overrides: Any) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate(spec_dict(**overrides))


def example_documents() -> dict[str, dict[str, Any]]:
    """examples/*.yaml by file name."""
    return {
        path.name: yaml.safe_load(path.read_text()) for path in sorted(EXAMPLES_DIR.glob("*.yaml"))
    }
