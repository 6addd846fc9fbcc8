"""`davit operator` and `davit crds`: flag validation and the console entry."""

from __future__ import annotations

import subprocess
import sys

import pytest

from davit_operator.cli import run_operator


def test_crds_check_through_the_console_entry() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "davit_cli", "crds", "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "up to date" in result.stdout


def test_operator_requires_a_scope(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run_operator([])
    assert exit_info.value.code == 2
    assert "--namespace" in capsys.readouterr().err


def test_operator_refuses_a_non_positive_drift_interval(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_operator(["-A", "--drift-interval", "0"]) == 2
    assert "--drift-interval must be > 0 seconds, got 0.0" in capsys.readouterr().err


def test_peering_priorities_are_distinct_unless_given() -> None:
    from davit_operator.cli import peering_priority

    assert peering_priority(None, None) == 0
    assert peering_priority("davit", 7) == 7
    drawn = {peering_priority("davit", None) for _ in range(20)}
    # kopf freezes every peer when two share a priority: replicas must not tie.
    assert len(drawn) == 20 and all(p >= 1 for p in drawn)
