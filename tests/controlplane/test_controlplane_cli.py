"""``python -m davit_operator.devcluster``: a detached cluster outlives ``up`` and ``down`` ends it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from davit_operator.devcluster import LocalCluster
from davit_operator.devcluster.cli import devcluster_main

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _cli(state_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "davit_operator.devcluster", f"--state-dir={state_dir}", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_up_status_env_down(tmp_path: Path) -> None:
    state = tmp_path / "cluster"
    assert _cli(state, "status").returncode == 1
    assert _cli(state, "env").returncode == 1

    up = _cli(state, "up")
    cluster = LocalCluster.from_state(state)
    try:
        assert up.returncode == 0, up.stderr
        kubeconfig = Path(up.stdout.strip())
        assert kubeconfig == state / "kubeconfig"
        assert "ready in" in up.stderr

        # The command has returned; its components keep running in their own sessions.
        assert cluster is not None and cluster.is_running()
        for record in cluster.processes:
            assert os.getsid(record.pid) == record.pid, f"{record.name} is not in its own session"
        nodes = cluster.kubectl("get", "nodes", "-o", "name").stdout.split()
        assert len(nodes) == 5

        again = _cli(state, "up")
        assert again.returncode == 0 and "already running" in again.stderr
        assert again.stdout.strip() == str(kubeconfig)

        status = _cli(state, "status")
        assert status.returncode == 0, status.stdout + status.stderr
        assert "gpu-h200-0" in status.stdout and "STOPPED" not in status.stdout

        env = _cli(state, "env")
        assert env.stdout.splitlines()[0] == f"export KUBECONFIG={kubeconfig}"
        # What a shell does with it: eval, then a plain kubectl reaches this cluster.
        shell = subprocess.run(
            ["bash", "-c", 'eval "$1" && kubectl get nodes -o name', "bash", env.stdout],
            capture_output=True,
            text=True,
            timeout=60,
            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        )
        assert shell.returncode == 0, shell.stderr
        assert len(shell.stdout.split()) == 5
    finally:
        down = _cli(state, "down")
    assert down.returncode == 0, down.stderr
    assert cluster is not None
    assert not any(r.is_alive() for r in cluster.processes)
    assert _cli(state, "status").returncode == 1
    assert (state / "logs" / "kube-apiserver.log").stat().st_size > 0


def test_down_without_a_cluster_is_a_no_op(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert devcluster_main([f"--state-dir={tmp_path}", "down"]) == 0
    assert "nothing to stop" in capsys.readouterr().err
