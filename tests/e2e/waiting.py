"""Polling with the operator's log in the failure message, for the end-to-end tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

LOG_TAIL_CHARS = 5000


def wait_until(what: str, probe: Callable[[], Any], timeout: float, operator_log: Path) -> Any:
    """`probe()`'s first true value, polled every half second; after `timeout` seconds an
    AssertionError naming `what` with the end of the operator's log."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            log = operator_log.read_text(errors="replace")[-LOG_TAIL_CHARS:]
            raise AssertionError(f"{what}: not within {timeout} s\noperator log:\n{log}")
        time.sleep(0.5)
