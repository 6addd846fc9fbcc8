"""The `davit` dispatcher: every command reaches its half, and a missing half is named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from davit_cli import COMMANDS, main

REPO = Path(__file__).resolve().parents[2]


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert f"  {name} " in out, name


def test_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_target_exists(name: str) -> None:
    import importlib

    module, _, attr = COMMANDS[name].target.partition(":")
    assert callable(getattr(importlib.import_module(module), attr))


def test_cluster_reaches_the_devcluster(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["cluster", "--help"])
    assert exit_info.value.code == 0
    assert "up" in capsys.readouterr().out


def test_a_missing_half_is_named(tmp_path: Path) -> None:
    """With only the dispatcher and the contract on the path (an operator image has no
    engine), `davit serve` says which distribution provides it."""
    code = (
        "import sys; sys.path[:] = [p for p in sys.path if 'site-packages' not in p "
        f"and not p.startswith({str(REPO)!r})] + {[str(REPO / 'cli'), str(REPO / 'contract')]!r};"
        "from davit_cli import main; sys.exit(main(['serve', 'x']))"
    )
    result = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 2, result.stderr
    assert "davit-engine distribution, which is not installed" in result.stderr
