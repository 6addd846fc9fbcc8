"""The engine core's way out: output messages written to the pipe by a thread of their own.

The core loop must never wait for the API process: a full pipe (the API process busy with HTTP
work) would otherwise stall the loop, and with it the device, until the reader catches up.
Messages are written in the order they were sent; steps that queue up behind a message still
being written go out as one `Deltas` (`Deltas.coalesce`), so a reader that fell behind
catches up with fewer, larger messages instead of one per step.
"""

from __future__ import annotations

import threading
from collections import deque
from multiprocessing.connection import Connection

from davit_engine.ipc.framing import write_message
from davit_engine.ipc.messages import Deltas, OutputMessage


class OutputSender:
    """Writes output messages to the pipe from its own thread, in the order they were sent.

    `send()` never blocks on the pipe. Consecutive `Deltas` waiting behind a message that is
    still being written are coalesced into one. `close()` writes everything still queued and
    stops the thread. A message that cannot be sent leaves its error in `failure`, which the
    loop raises on its next `check()`; once the pipe itself failed (the API process is gone),
    later messages are dropped.
    """

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.failure: Exception | None = None
        self._pipe_broken = False
        self._queue: deque[OutputMessage | None] = deque()  # None: stop after what is queued
        self._wakeup = threading.Condition()
        self._thread = threading.Thread(
            target=self._write_loop, name="davit-engine-core-sender", daemon=True
        )
        self._thread.start()

    def send(self, message: OutputMessage) -> None:
        with self._wakeup:
            self._queue.append(message)
            self._wakeup.notify()

    def check(self) -> None:
        """Raise the error that stopped the writer, if any."""
        if self.failure is not None:
            raise self.failure

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, then stop the thread (waits at most `timeout_s`)."""
        if self._thread.is_alive():
            with self._wakeup:
                self._queue.append(None)
                self._wakeup.notify()
            self._thread.join(timeout_s)

    def _next_batch(self) -> list[OutputMessage | None]:
        with self._wakeup:
            while not self._queue:
                self._wakeup.wait()
            batch = list(self._queue)
            self._queue.clear()
        return batch

    def _write_loop(self) -> None:
        while True:
            for message in _coalesced(self._next_batch()):
                if message is None:
                    return
                if self._pipe_broken:
                    continue
                try:
                    write_message(self.connection.fileno(), message)
                except OSError as exc:
                    self.failure = exc
                    self._pipe_broken = True
                except Exception as exc:  # not picklable: raised in the loop by check()
                    self.failure = exc


def _coalesced(batch: list[OutputMessage | None]) -> list[OutputMessage | None]:
    """`batch` in order, each run of consecutive `Deltas` merged into one."""
    out: list[OutputMessage | None] = []
    run: list[Deltas] = []
    for message in batch:
        if isinstance(message, Deltas):
            run.append(message)
            continue
        if run:
            out.append(Deltas.coalesce(run))
            run = []
        out.append(message)
    if run:
        out.append(Deltas.coalesce(run))
    return out
