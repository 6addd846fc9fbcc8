"""Fixtures for the packaging tests: the tools from hack/packaging/tools.sh and a helm wrapper."""

from __future__ import annotations

import pytest

from .tools import Helm, Tools, install_tools


@pytest.fixture(scope="session")
def packaging_tools() -> Tools:
    try:
        return install_tools()
    except RuntimeError as err:
        pytest.fail(str(err), pytrace=False)


@pytest.fixture(scope="session")
def helm(packaging_tools: Tools, tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return Helm(packaging_tools.helm, tmp_path_factory.mktemp("helm-state"))
