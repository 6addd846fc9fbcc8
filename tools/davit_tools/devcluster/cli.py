"""``python -m davit_tools.devcluster up|down|status|env``: one detached local cluster.

The cluster's state (certificates, kubeconfig, etcd data, logs, pids) lives in
``${DAVIT_CACHE:-~/.cache/davit}/cluster/``. ``up`` prints the kubeconfig path on stdout (and
nothing else), so ``export KUBECONFIG=$(python -m davit_tools.devcluster up)`` works.
"""

from __future__ import annotations

import argparse
import fcntl
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .cluster import LocalCluster
from .paths import cli_state_dir
from .process import ClusterError


def devcluster_main(argv: list[str], prog: str | None = None) -> int:
    """Entry point shared by ``python -m davit_tools.devcluster`` and ``davit cluster``.

    ``argv`` excludes the program name; ``prog`` is the name shown in help and usage messages.
    Returns the exit status.
    """
    parser = argparse.ArgumentParser(
        prog=prog or "python -m davit_tools.devcluster",
        description="Run a local Kubernetes control plane with fake GPU nodes (KWOK).",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where the cluster keeps its state and logs (default: $DAVIT_CACHE/cluster)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the cluster in the background; print the kubeconfig path")
    up.add_argument("--timeout", type=float, default=180.0, help="startup timeout in seconds")
    sub.add_parser("down", help="stop the cluster")
    sub.add_parser("status", help="report the components and nodes; exit 1 when not running")
    sub.add_parser(
        "env",
        help="print `export KUBECONFIG=...` (and PATH with the matching kubectl) for a shell to eval",
    )
    args = parser.parse_args(argv)
    state_dir: Path = args.state_dir or cli_state_dir()
    try:
        if args.command == "up":
            with _exclusive(state_dir):
                return _up(state_dir, args.timeout)
        if args.command == "down":
            with _exclusive(state_dir):
                return _down(state_dir)
        if args.command == "status":
            return _status(state_dir)
        return _env(state_dir)
    except ClusterError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


@contextmanager
def _exclusive(state_dir: Path) -> Iterator[None]:
    """Serializes ``up`` and ``down`` on one state folder (two ``up`` at once would otherwise
    start two clusters and keep only one in the state file)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another up/down on {state_dir} ...", file=sys.stderr)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _up(state_dir: Path, timeout: float) -> int:
    existing = LocalCluster.from_state(state_dir)
    if existing is not None:
        if existing.is_running():
            print(f"already running at {existing.server}", file=sys.stderr)
            print(existing.kubeconfig)
            return 0
        # Some component died: take the rest down and start clean.
        print("found a partly stopped cluster; stopping its remains", file=sys.stderr)
        existing.stop()
    cluster = LocalCluster(state_dir, detached=True, startup_timeout=timeout)
    print(f"starting the local control plane (logs in {cluster.log_dir}) ...", file=sys.stderr)
    cluster.start()
    print(
        f"ready in {cluster.startup_seconds:.1f} s at {cluster.server} with "
        f"{len(cluster.nodes)} fake nodes; stop it with `python -m davit_tools.devcluster down`",
        file=sys.stderr,
    )
    print(cluster.kubeconfig)
    return 0


def _down(state_dir: Path) -> int:
    cluster = LocalCluster.from_state(state_dir)
    if cluster is None:
        print(f"no cluster recorded in {state_dir}; nothing to stop", file=sys.stderr)
        return 0
    cluster.stop()
    print(f"stopped (logs kept in {cluster.log_dir})", file=sys.stderr)
    return 0


def _status(state_dir: Path) -> int:
    cluster = LocalCluster.from_state(state_dir)
    if cluster is None:
        print(f"not running (no cluster recorded in {state_dir})")
        return 1
    for record in cluster.processes:
        state = "running" if record.is_alive() else "STOPPED"
        print(f"{record.name:<24} pid {record.pid:<8} {state}  log {record.log}")
    print(f"server      {cluster.server}")
    print(f"kubeconfig  {cluster.kubeconfig}")
    if not cluster.is_running():
        print("not running: some components stopped; run `up` to restart")
        return 1
    nodes = cluster.kubectl("get", "nodes", "-L", "node.kubernetes.io/instance-type", check=False)
    print(nodes.stdout.rstrip() or nodes.stderr.rstrip())
    return 0 if nodes.returncode == 0 else 1


def _env(state_dir: Path) -> int:
    cluster = LocalCluster.from_state(state_dir)
    if cluster is None or not cluster.is_running():
        print(
            "error: no running cluster; start one with `python -m davit_tools.devcluster up`",
            file=sys.stderr,
        )
        return 1
    print(f"export KUBECONFIG={shlex.quote(str(cluster.kubeconfig))}")
    print(f'export PATH={shlex.quote(str(cluster.bin_dir))}:"$PATH"')
    return 0
