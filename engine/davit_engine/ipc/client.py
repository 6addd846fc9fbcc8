"""The API process's handle on the engine-core process.

`AsyncEngineClient` spawns the core process, waits for it to report `Ready`, and routes what it
sends back: admission answers to the handler awaiting them, deltas to per-request asyncio queues,
stats replies to their callers. A reader thread blocks on the pipe (and on the process sentinel)
so the event loop never does; it hands every message to the loop with `call_soon_threadsafe`.

If the core process dies, every waiting handler gets `EngineDeadError` instead of hanging.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from davit_engine.config import EngineConfig
from davit_engine.ipc.core_process import DEFAULT_CORE_FACTORY, run_engine_core
from davit_engine.ipc.messages import (
    AbortRequests,
    AddRequest,
    Admitted,
    CoreFailed,
    Deltas,
    GetStats,
    InputMessage,
    OutputMessage,
    Ready,
    Rejected,
    Shutdown,
    StatsReply,
)
from davit_engine.types import EngineRequest, EngineStats, RequestDelta

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine-core process is not running (failed to start, crashed or shut down)."""


class AdmissionError(Exception):
    """The core refused a request; `rejection` says why (see `messages.Rejected`)."""

    def __init__(self, rejection: Rejected) -> None:
        super().__init__(rejection.message)
        self.rejection = rejection


@dataclass
class RequestStream:
    """Deltas for one admitted request, in order; an `EngineDeadError` item ends it early."""

    request_id: str
    queue: asyncio.Queue[RequestDelta | EngineDeadError]

    async def next(self) -> RequestDelta:
        item = await self.queue.get()
        if isinstance(item, EngineDeadError):
            raise item
        return item

    def next_nowait(self) -> RequestDelta | None:
        """The next delta if one is already queued, else None (never waits)."""
        try:
            item = self.queue.get_nowait()
        except asyncio.QueueEmpty:
            return None
        if isinstance(item, EngineDeadError):
            raise item
        return item


class AsyncEngineClient:
    """Start, talk to and stop one engine-core process. All methods run on one event loop."""

    def __init__(self, config: EngineConfig, core_factory: str = DEFAULT_CORE_FACTORY) -> None:
        self.config = config
        self.core_factory = core_factory
        self.model_info: dict[str, Any] = {}
        self.dead_reason: str | None = None
        self.latest_stats: EngineStats | None = None  # as of the core's last step
        self._loop: asyncio.AbstractEventLoop | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._inputs: Any = None  # multiprocessing.Queue[InputMessage]
        self._outputs: Connection | None = None
        self._reader: threading.Thread | None = None
        self._ready: asyncio.Future[None] | None = None
        self._admissions: dict[str, asyncio.Future[None]] = {}
        self._streams: dict[str, RequestStream] = {}
        self._stats_waiters: dict[int, asyncio.Future[EngineStats]] = {}
        self._tokens = itertools.count()
        self._failure_message: str | None = None
        self._stopping = False

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self, timeout_s: float | None = None) -> None:
        """Spawn the core process and wait until it has loaded the model (or failed to)."""
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        # Retrieved here so a failure after start() stopped waiting is not logged as unretrieved.
        self._ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        ctx = multiprocessing.get_context("spawn")
        self._inputs = ctx.Queue()
        reader_end, writer_end = ctx.Pipe(duplex=False)
        self._outputs = reader_end
        self._process = ctx.Process(
            target=run_engine_core,
            args=(self.config, self.core_factory, self._inputs, writer_end, os.getpid()),
            name="davit-engine-core",
            daemon=True,
        )
        self._process.start()
        # The child holds the only write end now; closing ours lets recv() see EOF on its death.
        writer_end.close()
        self._reader = threading.Thread(
            target=self._read_outputs, name="davit-engine-core-reader", daemon=True
        )
        self._reader.start()
        await asyncio.wait_for(asyncio.shield(self._ready), timeout_s)

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None and self._process is not None and self._process.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the core to exit, wait for it, and kill it if it does not go in time."""
        self._stopping = True
        process = self._process
        if process is None:
            return
        if process.is_alive():
            started = time.monotonic()
            self._send(Shutdown())
            await asyncio.to_thread(process.join, timeout_s)
            logger.info("engine core stopped in %.1f s", time.monotonic() - started)
            if process.is_alive():
                logger.warning("engine core did not exit in %.0f s; killing it", timeout_s)
                process.kill()
                await asyncio.to_thread(process.join, 5.0)
        if self._reader is not None:
            await asyncio.to_thread(self._reader.join, 5.0)
        if self._inputs is not None:
            self._inputs.close()
            self._inputs.cancel_join_thread()
        self._mark_dead("engine core was shut down")

    # --- requests ---------------------------------------------------------------------------

    async def add_request(self, request: EngineRequest) -> RequestStream:
        """Submit `request` and wait for the core's admission answer.

        Raises `AdmissionError` when the core refuses it (bad parameter, full queue) and
        `EngineDeadError` when the core is not running. On success the returned stream yields
        the request's deltas; the caller must `abort()` it if it stops reading early.
        """
        loop = self._require_loop()
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        request_id = request.request_id
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        stream = RequestStream(request_id, asyncio.Queue())
        admitted: asyncio.Future[None] = loop.create_future()
        self._streams[request_id] = stream
        self._admissions[request_id] = admitted
        try:
            self._send(AddRequest(request))
            await admitted
        except (AdmissionError, EngineDeadError):
            self._admissions.pop(request_id, None)
            self._streams.pop(request_id, None)
            raise
        except asyncio.CancelledError:
            # The handler went away while waiting: the core may still admit the request, and
            # the abort (queued after the add) makes it drop it again.
            self._admissions.pop(request_id, None)
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request early (client gone, stop string matched). Safe to call twice."""
        if self._streams.pop(request_id, None) is not None and self.dead_reason is None:
            self._send(AbortRequests([request_id]))

    def release(self, request_id: str) -> None:
        """Forget a request the core already finished (its last delta was received)."""
        self._streams.pop(request_id, None)

    async def get_stats(self, timeout_s: float = 5.0) -> EngineStats:
        """A fresh snapshot from the core (answered between two engine steps)."""
        loop = self._require_loop()
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        token = next(self._tokens)
        waiter: asyncio.Future[EngineStats] = loop.create_future()
        self._stats_waiters[token] = waiter
        try:
            self._send(GetStats(token))
            return await asyncio.wait_for(waiter, timeout_s)
        finally:
            self._stats_waiters.pop(token, None)

    # --- plumbing ---------------------------------------------------------------------------

    def _require_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise EngineDeadError("engine core was never started")
        return self._loop

    def _send(self, message: InputMessage) -> None:
        # multiprocessing.Queue.put hands the message to a feeder thread: it never blocks here.
        self._inputs.put(message)

    def _read_outputs(self) -> None:
        """Reader thread: forward every message to the loop; report the process's death."""
        assert self._outputs is not None and self._process is not None and self._loop is not None
        conn, sentinel, loop = self._outputs, self._process.sentinel, self._loop
        reason = "engine core process exited"
        while True:
            ready = wait([conn, sentinel])
            if conn not in ready:
                break  # the process died and its pipe holds nothing more
            try:
                message: OutputMessage = conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(message, CoreFailed):
                reason = message.message
            try:
                loop.call_soon_threadsafe(self._dispatch, message)
            except RuntimeError:
                return  # the loop is closed: the API process is exiting
        exitcode = self._process.exitcode
        if exitcode is None:
            self._process.join(1.0)
            exitcode = self._process.exitcode
        full_reason = f"{reason} (exit code {exitcode})"
        try:
            loop.call_soon_threadsafe(self._mark_dead, full_reason)
        except RuntimeError:
            return

    def _dispatch(self, message: OutputMessage) -> None:
        if isinstance(message, Deltas):
            if message.stats is not None:
                self.latest_stats = message.stats
            for delta in message.deltas:
                stream = self._streams.get(delta.request_id)
                if stream is None:
                    continue  # aborted meanwhile; the core drops it too
                stream.queue.put_nowait(delta)
                if delta.finished:
                    del self._streams[delta.request_id]
        elif isinstance(message, Admitted):
            future = self._admissions.pop(message.request_id, None)
            if future is not None and not future.done():
                future.set_result(None)
        elif isinstance(message, Rejected):
            future = self._admissions.pop(message.request_id, None)
            if future is not None and not future.done():
                future.set_exception(AdmissionError(message))
        elif isinstance(message, StatsReply):
            waiter = self._stats_waiters.get(message.token)
            if waiter is not None and not waiter.done():
                waiter.set_result(message.stats)
        elif isinstance(message, Ready):
            self.model_info = message.model_info
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(None)
        elif isinstance(message, CoreFailed):
            # The core exits right after sending this; fail waiters now rather than after the
            # process has finished tearing down.
            self._failure_message = message.message
            self._mark_dead(message.message)

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        if self._failure_message is not None and not self._stopping:
            reason = self._failure_message
        self.dead_reason = reason
        if not self._stopping:
            logger.error("engine core is dead: %s", reason)
        error = EngineDeadError(reason)
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(error)
        for future in self._admissions.values():
            if not future.done():
                future.set_exception(error)
        for waiter in self._stats_waiters.values():
            if not waiter.done():
                waiter.set_exception(error)
        for stream in self._streams.values():
            stream.queue.put_nowait(error)
        self._admissions.clear()
        self._streams.clear()
