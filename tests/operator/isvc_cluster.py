"""Helpers for operator tests on the local control plane: the operator process, polling."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import yaml

if TYPE_CHECKING:
    from davit_tools.devcluster import LocalCluster


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class OperatorProcess:
    """`davit operator` running as a child process against the test cluster."""

    def __init__(
        self,
        cluster: LocalCluster,
        namespace: str,
        log_path: Path,
        drift_interval: float,
        all_namespaces: bool = False,
        memory_profiling: bool = False,
    ) -> None:
        self.cluster = cluster
        # Off unless a test is about it: profiling Jobs need a termination message that only
        # the test can write (KWOK runs no containers).
        self.memory_profiling = memory_profiling
        self.namespace = namespace
        self.log_path = log_path
        self.drift_interval = drift_interval
        self.all_namespaces = all_namespaces
        self.metrics_port = free_port()
        self.liveness_port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> OperatorProcess:
        argv = [
            sys.executable,
            "-m",
            "davit_cli",
            "operator",
            *(["--all-namespaces"] if self.all_namespaces else ["--namespace", self.namespace]),
            "--kubeconfig",
            str(self.cluster.kubeconfig),
            "--metrics-port",
            str(self.metrics_port),
            "--liveness",
            f"http://127.0.0.1:{self.liveness_port}/healthz",
            "--drift-interval",
            str(self.drift_interval),
        ]
        if not self.memory_profiling:
            argv.append("--no-memory-profiling")
        # Fake nodes run no fetch Job: hf:// specs opt out of the model cache operator-wide.
        argv += ["--model-cache", "emptyDir"]
        if os.environ.get("DAVIT_TEST_OPERATOR_VERBOSE"):
            argv.append("--verbose")
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"the operator exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.liveness_port}/healthz").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        pytest.fail(f"the operator was not live within {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def peak_rss_mib(self) -> float:
        """VmHWM of the operator process (peak resident memory)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmHWM in /proc status")

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics").text
        total = 0.0
        for line in text.splitlines():
            if line.startswith("#") or not line.startswith(name):
                continue
            head, _, value = line.rpartition(" ")
            if head.split("{")[0] != name:
                continue
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(sig)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


def apply_yaml(cluster: LocalCluster, namespace: str, documents: list[dict[str, Any]]) -> None:
    """Server-side apply documents into `namespace` (kubectl, like a user or GitOps tool)."""
    cluster.kubectl(
        "apply", "--server-side", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(documents)
    )


def wait_for(
    what: str, probe: Callable[[], Any], timeout: float = 90.0, interval: float = 0.5
) -> Any:
    """Poll `probe` until it returns a truthy value; fail with `what` on timeout."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return dict(cond)
    return {}


def get_json(cluster: LocalCluster, *args: str) -> Any:
    return json.loads(cluster.kubectl(*args, "-o", "json").stdout)
