"""`davit operator|crds|cluster` dispatch and flag validation."""

from __future__ import annotations

import subprocess
import sys

import pytest

from davit_operator.cli import operator_cli_main


def test_crds_check_through_the_console_entry() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "davit_engine.cli", "crds", "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "up to date" in result.stdout


def test_operator_requires_a_scope(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        operator_cli_main("operator", [])
    assert exit_info.value.code == 2
    assert "--namespace" in capsys.readouterr().err


def test_operator_refuses_a_non_positive_drift_interval(capsys: pytest.CaptureFixture[str]) -> None:
    assert operator_cli_main("operator", ["-A", "--drift-interval", "0"]) == 2
    assert "--drift-interval must be > 0 seconds, got 0.0" in capsys.readouterr().err


def test_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert operator_cli_main("serve", []) == 2
    assert "not an operator command" in capsys.readouterr().err


def test_cluster_is_forwarded_to_the_devcluster(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        operator_cli_main("cluster", ["--help"])
    assert exit_info.value.code == 0
    assert "up" in capsys.readouterr().out


def test_demo_refuses_an_unknown_example(capsys: pytest.CaptureFixture[str]) -> None:
    from davit_operator.demo import main

    assert main(["no-such-example.yaml"]) == 2
    err = capsys.readouterr().err
    assert "no such example no-such-example.yaml" in err and "cpu-smollm2.yaml" in err


def test_peering_priorities_are_distinct_unless_given() -> None:
    from davit_operator.cli import peering_priority

    assert peering_priority(None, None) == 0
    assert peering_priority("davit", 7) == 7
    drawn = {peering_priority("davit", None) for _ in range(20)}
    # kopf freezes every peer when two share a priority: replicas must not tie.
    assert len(drawn) == 20 and all(p >= 1 for p in drawn)
