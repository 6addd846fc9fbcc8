"""``python -m davit_tools.devcluster``: a detached cluster outlives ``up`` and ``down`` ends it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from davit_tools.devcluster import LocalCluster
from davit_tools.devcluster.cli import devcluster_main

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _cli(state_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "davit_tools.devcluster", f"--state-dir={state_dir}", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_up_status_env_down(tmp_path: Path) -> None:
    state = tmp_path / "cluster"
    assert _cli(state, "status").returncode == 1
    assert _cli(state, "env").returncode == 1

    # Two `up` at once: one starts the cluster, the other waits for it and reuses it.
    argv = [sys.executable, "-m", "davit_tools.devcluster", f"--state-dir={state}", "up"]
    racers = [
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outcomes = [proc.communicate(timeout=300) + (proc.returncode,) for proc in racers]
    cluster = LocalCluster.from_state(state)
    try:
        assert [rc for _, _, rc in outcomes] == [0, 0], [err for _, err, _ in outcomes]
        assert sorted("ready in" in err for _, err, _ in outcomes) == [False, True]
        assert sorted("already running" in err for _, err, _ in outcomes) == [False, True]
        kubeconfig = Path(outcomes[0][0].strip())
        assert kubeconfig == state / "kubeconfig"
        assert outcomes[1][0].strip() == str(kubeconfig)
        # Exactly one set of components runs for this state folder.
        assert len(_processes_mentioning(str(state))) == 5

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


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(int(proc.name))
    return found
