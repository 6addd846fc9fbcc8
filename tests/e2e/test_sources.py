"""The delivery tests' model sources come from the install step: the versions the tests look
for are the ones it installs, and a missing one fails the suite under `make test` instead of
skipping the delivery tests."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import REQUIRE_ENV

from .sources import OLAH_VERSION, VERSITYGW_VERSION, HubMirror, S3Server

ROOT = Path(__file__).resolve().parents[2]


def test_the_install_step_installs_the_versions_the_tests_use() -> None:
    install = (ROOT / "hack" / "install.sh").read_text()
    assert re.search(rf"^olah_version={re.escape(OLAH_VERSION)}\b", install, re.MULTILINE)
    assert "bash hack/s3server/build.sh" in install
    assert "tests.e2e.model_store" in install
    go_mod = (ROOT / "hack" / "s3server" / "go.mod").read_text()
    assert re.search(
        rf"^\s*github\.com/versity/versitygw {re.escape(VERSITYGW_VERSION)}\b",
        go_mod,
        re.MULTILINE,
    )


@pytest.mark.parametrize("source", ["hub", "s3"])
def test_a_missing_source_fails_under_the_test_command(
    source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DAVIT_CACHE", str(tmp_path / "empty-cache"))

    def start() -> object:
        if source == "hub":
            return HubMirror(tmp_path / "model", tmp_path / "hub").start()
        return S3Server(tmp_path / "s3").start()

    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception) as failed:
        start()
    assert "hack/install.sh" in str(failed.value) and str(tmp_path) in str(failed.value)
    monkeypatch.delenv(REQUIRE_ENV)
    with pytest.raises(pytest.skip.Exception):
        start()
