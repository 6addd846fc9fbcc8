"""The API process's handle on the engine-core process.

`AsyncEngineClient` spawns the core process, waits for it to report `Ready`, and routes what it
sends back: admission answers to the handler awaiting them, deltas to per-request streams,
stats replies to their callers. The event loop watches the pipe (and the process sentinel)
itself and reads it without blocking (`framing.MessageReader`): every message that arrived is
dispatched in one callback, with no thread and no hand-off per message. A stream collects the
deltas that arrive and wakes its reader once; the reader takes all of them in one `take()`.

If the core process dies, every waiting handler gets `EngineDeadError` instead of hanging.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import time
from multiprocessing.connection import Connection
from typing import Any

from davit_engine.config import EngineConfig
from davit_engine.ipc.core_process import DEFAULT_CORE_FACTORY, run_engine_core
from davit_engine.ipc.errors import AdmissionError, EngineDeadError
from davit_engine.ipc.framing import MessageReader
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
from davit_engine.ipc.request_stream import RequestStream
from davit_engine.types import EngineRequest, EngineStats

logger = logging.getLogger(__name__)


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
        self._reader: MessageReader | None = None
        self._watched: list[int] = []  # file descriptors the loop watches for us
        self._exit_task: asyncio.Task[None] | None = None
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
            # A daemonic process may not start processes: the tensor-parallel ranks' core is
            # not one (shutdown() still stops it).
            daemon=self.config.tensor_parallel_size == 1,
        )
        self._process.start()
        # The child holds the only write end now; closing ours lets a read see EOF on its death.
        writer_end.close()
        self._reader = MessageReader(reader_end.fileno())
        self._loop.add_reader(self._reader.fd, self._on_readable)
        # A process the core started may hold the pipe open after the core died: the sentinel
        # tells its death regardless.
        self._loop.add_reader(self._process.sentinel, self._on_exit)
        self._watched = [self._reader.fd, self._process.sentinel]
        await asyncio.wait_for(asyncio.shield(self._ready), timeout_s)

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None and self._process is not None and self._process.is_alive()

    @property
    def core_pid(self) -> int | None:
        """The engine-core process's id; None before `start()`."""
        return None if self._process is None else self._process.pid

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
        self._on_exit()
        if self._exit_task is not None:
            await asyncio.gather(self._exit_task, return_exceptions=True)
        if self._outputs is not None:
            self._outputs.close()
            self._outputs = None
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
        stream = RequestStream(request_id)
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

    def _on_readable(self) -> None:
        """The pipe has bytes (or hit EOF): dispatch every message they complete."""
        if self._reader is None:
            return
        messages, eof = self._reader.read()
        for message in messages:
            self._dispatch(message)
        if eof:
            self._on_exit()

    def _on_exit(self) -> None:
        """The core process exited or closed the pipe: take what it sent, then fail the rest."""
        if not self._watched:
            return
        loop = self._require_loop()
        for fd in self._watched:
            loop.remove_reader(fd)
        self._watched = []
        if self._reader is not None:
            for message in self._reader.read()[0]:
                self._dispatch(message)
            self._reader = None
        self._exit_task = loop.create_task(self._report_exit())

    async def _report_exit(self) -> None:
        process = self._process
        assert process is not None
        if process.exitcode is None:
            await asyncio.to_thread(process.join, 1.0)
        if self._stopping:
            self._mark_dead("engine core was shut down")
        else:
            self._mark_dead(f"engine core process exited (exit code {process.exitcode})")

    def _dispatch(self, message: OutputMessage) -> None:
        if isinstance(message, Deltas):
            if message.stats is not None:
                self.latest_stats = message.stats
            streams = self._streams
            for delta in message.deltas:
                stream = streams.get(delta.request_id)
                if stream is None:
                    continue  # aborted meanwhile; the core drops it too
                stream.put(delta)
                if delta.finish_reason is not None:
                    del streams[delta.request_id]
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
            stream.fail(error)
        self._admissions.clear()
        self._streams.clear()
