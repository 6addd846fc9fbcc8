"""Starting, probing and stopping one control-plane process.

A process is identified by its pid *and* its start time (from ``/proc``), so a later ``down`` never
signals an unrelated process that happens to have reused the pid.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path


class ClusterError(RuntimeError):
    """The local control plane could not be built, started, reached or stopped."""


@dataclass(frozen=True)
class ProcessRecord:
    """What is persisted about a running component (in the cluster's state file)."""

    name: str
    pid: int
    start_ticks: int
    log: str
    health_url: str

    def is_alive(self) -> bool:
        return process_start_ticks(self.pid) == self.start_ticks


def process_start_ticks(pid: int) -> int | None:
    """The process start time in clock ticks since boot, or None when no such process exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may contain spaces and parentheses; fields after the last ')'
    # are fixed. starttime is field 22, i.e. index 19 after the state field.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie has exited; only its parent's wait is missing
        return None
    return int(fields[19])


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports on 127.0.0.1 that were free a moment ago."""
    with ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
        return ports


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Attached clusters must not outlive the Python process that owns them (a killed pytest run
    # would otherwise leave an API server behind). Linux only; elsewhere the harness stops them.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def spawn(name: str, argv: list[str], log: Path, *, detached: bool) -> subprocess.Popen[bytes]:
    """Starts ``argv`` in its own session with stdout and stderr appended to ``log``.

    ``detached`` processes survive the caller; attached ones started from the main thread receive
    SIGTERM when the caller dies.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    on_main_thread = threading.current_thread() is threading.main_thread()
    with open(log, "ab") as out:
        out.write(f"==> {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(argv)}\n".encode())
        out.flush()
        try:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # The parent-death signal fires when the *thread* that forked exits, so it is
                # only safe from the main thread; elsewhere stop() is the only cleanup.
                preexec_fn=None if detached or not on_main_thread else _die_with_parent,
            )
        except OSError as err:
            raise ClusterError(f"cannot start {name} ({argv[0]}): {err}") from err


def log_tail(log: Path, lines: int = 25) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text[-lines:])


def probe(url: str, context: ssl.SSLContext | None, timeout: float = 2.0) -> tuple[int, str]:
    """GET ``url``; returns (status, body) with status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")
    except (urllib.error.URLError, OSError, TimeoutError):
        return 0, ""


def wait_healthy(
    record: ProcessRecord,
    context: ssl.SSLContext | None,
    deadline: float,
    is_running: Callable[[], bool],
    accept: Callable[[str], bool] = lambda body: True,
) -> None:
    """Polls the component's health URL until it answers 200 (and ``accept(body)``).

    Raises ClusterError naming the component, with its log tail, when it exits or the deadline passes.
    """
    last = (0, "")
    while time.monotonic() < deadline:
        if not is_running():
            raise ClusterError(
                f"{record.name} exited during startup; last lines of {record.log}:\n"
                + log_tail(Path(record.log))
            )
        last = probe(record.health_url, context)
        if last[0] == 200 and accept(last[1]):
            return
        time.sleep(0.2)
    raise ClusterError(
        f"{record.name} did not become healthy at {record.health_url} "
        f"(last answer: {last[0] or 'no connection'} {last[1][:200]!r}); "
        f"last lines of {record.log}:\n" + log_tail(Path(record.log))
    )


def terminate(record: ProcessRecord, timeout: float = 15.0) -> bool:
    """SIGTERM, then SIGKILL after ``timeout``; True when the process was running."""
    if not record.is_alive():
        return False
    try:
        os.kill(record.pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not record.is_alive():
            return True
        time.sleep(0.1)
    try:
        os.kill(record.pid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + 5
    while record.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    if record.is_alive():
        raise ClusterError(f"{record.name} (pid {record.pid}) survived SIGKILL")
    return True
