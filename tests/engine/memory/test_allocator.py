from __future__ import annotations

import pytest

from davit_engine.memory.allocator import (
    ALLOC_CONF_ENV,
    SERVING_ALLOC_CONF,
    configure_cuda_allocator,
)


def test_expandable_segments_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALLOC_CONF_ENV, "placeholder")  # restored to the original on teardown
    monkeypatch.delenv(ALLOC_CONF_ENV)
    assert configure_cuda_allocator() == SERVING_ALLOC_CONF
    import os

    assert os.environ[ALLOC_CONF_ENV] == SERVING_ALLOC_CONF


def test_a_chosen_configuration_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALLOC_CONF_ENV, "max_split_size_mb:128")
    assert configure_cuda_allocator() == "max_split_size_mb:128"
    import os

    assert os.environ[ALLOC_CONF_ENV] == "max_split_size_mb:128"
