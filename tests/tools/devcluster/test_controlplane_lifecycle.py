"""LocalCluster's own lifecycle: context-manager use, cleanup, and failures that explain themselves."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from davit_tools.devcluster import ClusterError, FakeNode, LocalCluster
from davit_tools.devcluster.paths import BINARIES

pytestmark = pytest.mark.cluster


def test_context_manager_starts_custom_nodes_and_cleans_up(kube_cluster: LocalCluster) -> None:
    node = FakeNode(name="tiny", cpu=4, memory_gib=16, extended={"nvidia.com/gpu": 1})
    with LocalCluster(bin_dir=kube_cluster.bin_dir, nodes=[node]) as cluster:
        state_dir = cluster.state_dir
        assert state_dir.is_dir() and cluster.server.startswith("https://127.0.0.1:")
        names = cluster.kubectl("get", "nodes", "-o", "name").stdout.split()
        assert names == ["node/tiny"]
        records = cluster.processes
        assert [r.name for r in records] == [
            "etcd",
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler",
            "kwok",
        ]
        assert cluster.startup_seconds is not None and cluster.startup_seconds > 0
        assert cluster.is_running() and cluster.stopped_components() == []

        # A component that dies later is reported by name.
        kwok = records[-1]
        os.kill(kwok.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while kwok.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [r.name for r in cluster.stopped_components()] == ["kwok"]
        assert not cluster.is_running()
    assert not any(r.is_alive() for r in records)
    # A cluster started without a state folder removes its temporary one.
    assert not state_dir.exists()


def test_a_component_that_exits_is_named_with_its_log(
    kube_cluster: LocalCluster, tmp_path: Path
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in BINARIES:
        (bin_dir / name).symlink_to(kube_cluster.bin_dir / name)
    (tmp_path / "kwok-stages").symlink_to(kube_cluster.bin_dir.parent / "kwok-stages")
    (bin_dir / "kube-apiserver").unlink()
    broken = bin_dir / "kube-apiserver"
    broken.write_text("#!/bin/sh\necho 'error: invalid --etcd-servers value' >&2\nexit 3\n")
    broken.chmod(0o755)

    cluster = LocalCluster(tmp_path / "state", bin_dir=bin_dir, startup_timeout=60)
    with pytest.raises(ClusterError) as raised:
        cluster.start()
    message = str(raised.value)
    assert "kube-apiserver exited during startup" in message
    assert "invalid --etcd-servers value" in message
    # etcd had started before the failure; it must not be left running.
    assert cluster.processes == []
    assert (tmp_path / "state" / "logs" / "etcd.log").stat().st_size > 0
    assert _processes_mentioning(str(tmp_path / "state")) == []


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(proc.name))
    return found
