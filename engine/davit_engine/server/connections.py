"""Client connections: how long a client may take to send a request, and how large it may be.

uvicorn bounds only the idle time between two requests of a kept-alive connection. A client
that opens a connection and trickles its request head, or sends a head and then its body a
byte at a time (slowloris), would hold a connection and a task forever. Here:
- `guarded_h11_protocol(timeout)`: uvicorn's h11 protocol with a deadline for a request's head,
  counted from the connection's start or from the end of the previous response; a client that
  misses it is disconnected (no request started, so there is nobody to answer).
- `RequestBodyLimits`: reads the whole body before the app runs, answering 413 to a body over
  the limit (at once when Content-Length says so) and 408 to one that does not arrive within
  the deadline; both close the connection. The app then reads the body from memory.
- `uvicorn_config`: the uvicorn configuration `davit serve` (and the tests) serve the app with.

After a large body the process hands freed memory back to the system (`release_memory`): a
multi-megabyte prompt must not leave the API process larger than it was.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from collections.abc import Callable
from typing import Any

import uvicorn
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from davit_engine.server.errors import error_response
from davit_engine.server.state import ServerSettings

logger = logging.getLogger(__name__)


# Bodies at least this large are followed by `release_memory()`.
LARGE_BODY_BYTES = 1024 * 1024
# Seconds uvicorn gives connections still open after the drain (or after SIGINT) before it
# cancels them.
SHUTDOWN_GRACE_S = 3


def _load_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc: its allocator returns memory by itself
        return None
    return trim


_MALLOC_TRIM = _load_malloc_trim()
_trimming = False


async def release_memory() -> None:
    """Return the C heap's free pages to the system (glibc keeps them otherwise).

    Large prompts pass through buffers allocated outside Python's small-object pools (the
    body, the decoded text, the tokenizer's work); glibc would keep those pages mapped. One
    trim at a time, off the event loop: it walks the whole heap.
    """
    global _trimming
    if _MALLOC_TRIM is None or _trimming:
        return
    _trimming = True
    try:
        await asyncio.to_thread(_MALLOC_TRIM, 0)
    finally:
        _trimming = False


class RequestBodyLimits:
    """ASGI middleware: the body, whole, within `max_bytes` and `timeout_s`; else 413 / 408."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse_too_large(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                await self._refuse(
                    scope,
                    receive,
                    send,
                    408,
                    f"the request body did not arrive within {self.timeout_s:g} s",
                )
                return
            if message["type"] == "http.disconnect":
                return  # the client left; nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse_too_large(scope, receive, send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        del chunks
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            # After the body only the disconnect is left to wait for.
            return await receive()

        try:
            await self.app(scope, replay, send)
        finally:
            if size >= LARGE_BODY_BYTES:
                del body
                await release_memory()

    async def _refuse_too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = (
            f"the request body exceeds {self.max_bytes} bytes (--max-request-body-bytes); "
            "send a shorter prompt or fewer prompts per request"
        )
        await self._refuse(scope, receive, send, 413, message)

    @staticmethod
    async def _refuse(
        scope: Scope, receive: Receive, send: Send, status: int, message: str
    ) -> None:
        # The rest of the body is not read: the connection cannot be reused.
        response = error_response(status, message, headers={"Connection": "close"})
        await response(scope, receive, send)


class _GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol; a request head must arrive within `header_timeout_s`."""

    header_timeout_s: float = 60.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        self._waiting_after: object = None  # the cycle before the awaited request head
        super().connection_made(transport)
        self._await_request_head()

    def _await_request_head(self) -> None:
        self._cancel_header_timer()
        self._waiting_after = self.cycle
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._header_timer is not None and self.cycle is not self._waiting_after:
            self._cancel_header_timer()  # a new request started: its head is complete

    def on_response_complete(self) -> None:
        finished = self.cycle
        super().on_response_complete()  # may start a pipelined request at once
        if not self.transport.is_closing() and self.cycle is finished:
            self._await_request_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.cycle is self._waiting_after and not self.transport.is_closing():
            logger.info(
                "dropping %s: no complete request head within %g s",
                self.client,
                self.header_timeout_s,
            )
            self.transport.close()


def guarded_h11_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """The h11 protocol class with this request-head deadline."""
    return type(
        "GuardedH11Protocol", (_GuardedH11Protocol,), {"header_timeout_s": header_timeout_s}
    )


def uvicorn_config(app: Any, settings: ServerSettings, log_level: str = "info") -> uvicorn.Config:
    """How `davit serve` runs `app`: the guarded protocol, the settings' address."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        lifespan="on",
        http=guarded_h11_protocol(settings.request_read_timeout_s),
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
