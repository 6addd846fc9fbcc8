"""A lean HTTP/1.1 client for streamed (server-sent events) responses, for the load generators.

A load generator has to read the server's events faster than the server writes them, from one
process. httpx spends tens of microseconds of Python on every event it receives (its response
and line iterators, and a scan of its whole connection pool on every request), which caps a
single client process near the rate a fast server streams at. This client does the minimum:
it writes the request itself, reads whatever bytes the socket has in one call, takes the
chunked framing and the SSE event boundaries apart with a few buffer operations per read, and
hands each event's data to a callback together with the time its bytes arrived.

`SSEConnection` is one keep-alive connection; `ConnectionPool` reuses idle ones in O(1).
Only what the OpenAI-style streaming endpoints need is implemented: a JSON POST, a response
that is chunked, sized by Content-Length, or delimited by the connection closing, and SSE
events whose data fields are collected (comments and other fields are skipped).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

# Called with one event's data (the `data:` fields joined by newlines) and the
# `time.perf_counter()` at which the bytes carrying it were read; False stops the callbacks for
# the rest of this response, which is still read to its end so the connection stays usable.
OnEvent = Callable[[bytes, float], bool]

_READ_SIZE = 1 << 16


@dataclass
class CompletionChunk:
    """One streamed completion or chat-completion event, reduced to what a load generator
    counts: the first choice's text (or delta content), the usage's completion tokens when the
    event carries usage, or the error the server streamed instead."""

    text: str = ""
    completion_tokens: int | None = None
    error: str | None = None


def parse_completion_chunk(data: bytes) -> CompletionChunk | None:
    """The event's chunk; None for the final `[DONE]`."""
    if data == b"[DONE]":
        return None
    chunk = json.loads(data)
    if "error" in chunk:
        return CompletionChunk(error=str(chunk["error"].get("message")))
    usage = chunk.get("usage")
    tokens = int(usage["completion_tokens"]) if usage else None
    choices = chunk.get("choices")
    if not choices:
        return CompletionChunk(completion_tokens=tokens)
    choice = choices[0]
    text = choice["delta"].get("content") if "delta" in choice else choice.get("text")
    return CompletionChunk(text=text or "", completion_tokens=tokens)


class HTTPStatusError(Exception):
    """The server answered with a status other than 200; its body has been read."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail


@dataclass(frozen=True)
class Endpoint:
    """Where requests go: `http://host[:port][/prefix]` or `https://...`."""

    host: str
    port: int
    tls: bool
    prefix: str

    @classmethod
    def from_url(cls, url: str) -> Endpoint:
        """Parse a base URL; ValueError (naming the URL) for another scheme or no host."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not an http:// or https:// URL with a host")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        return cls(parts.hostname, port, tls, parts.path.rstrip("/"))

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == (443 if self.tls else 80) else f"{host}:{self.port}"


class SSEConnection:
    """One keep-alive HTTP/1.1 connection that POSTs JSON and reads SSE responses.

    One request at a time. After any exception other than `HTTPStatusError` the connection's
    state is unknown: close it (the next request then opens a new one).
    """

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: dict[str, Any], on_event: OnEvent) -> None:
        """POST `body` to `path` (under the endpoint's prefix); feed every SSE event to `on_event`.

        Returns once the whole response has been read. Raises `HTTPStatusError` for a status
        other than 200, `asyncio.IncompleteReadError` or `OSError` when the connection breaks,
        `ValueError` for a response that is not HTTP/1.1 as expected.
        """
        if self._reader is None or self._writer is None:
            ssl_context = ssl.create_default_context() if self.endpoint.tls else None
            self._reader, self._writer = await asyncio.open_connection(
                self.endpoint.host, self.endpoint.port, ssl=ssl_context
            )
        reader, writer = self._reader, self._writer
        payload = json.dumps(body).encode()
        writer.write(
            f"POST {self.endpoint.prefix}{path} HTTP/1.1\r\n"
            f"Host: {self.endpoint.host_header}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        status_line, *header_lines = head[:-4].split("\r\n")
        try:
            status = int(status_line.split(" ", 2)[1])
        except (IndexError, ValueError):
            raise ValueError(f"not an HTTP status line: {status_line[:80]!r}") from None
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        events = _EventSplitter(on_event if status == 200 else None)
        if headers.get("transfer-encoding", "").lower() == "chunked":
            await _read_chunked(reader, events)
        elif "content-length" in headers:
            data = await reader.readexactly(int(headers["content-length"]))
            events.feed(data, time.perf_counter())
        else:
            # No framing: the response ends when the server closes the connection.
            while data := await reader.read(_READ_SIZE):
                events.feed(data, time.perf_counter())
            self.close()
        if headers.get("connection", "").lower() == "close":
            self.close()
        if status != 200:
            raise HTTPStatusError(status, events.raw.decode(errors="replace")[:300])

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None


class ConnectionPool:
    """Idle keep-alive connections to one endpoint, reused last in, first out.

    `post` takes an idle connection (or opens one), and puts it back only when its response
    was read completely; a connection that failed or was cancelled is closed.
    """

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._idle: list[SSEConnection] = []

    async def post(self, path: str, body: dict[str, Any], on_event: OnEvent) -> None:
        """`SSEConnection.post` on a pooled connection."""
        connection = self._idle.pop() if self._idle else SSEConnection(self.endpoint)
        try:
            await connection.post(path, body, on_event)
        except HTTPStatusError:
            self._idle.append(connection)
            raise
        except BaseException:
            connection.close()
            raise
        self._idle.append(connection)

    def close(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()


class _EventSplitter:
    """Splits a response body into SSE events and hands their data to the callback.

    Without a callback (an error response) it keeps the raw body instead.
    """

    def __init__(self, on_event: OnEvent | None) -> None:
        self.on_event = on_event
        self.raw = b""
        self._pending = b""
        self._separator = b""

    def feed(self, data: bytes, arrived: float) -> None:
        if self.on_event is None:
            self.raw += data
            return
        pending = self._pending + data
        if not self._separator:
            # Servers end lines with LF or CRLF (SSE allows both); one response keeps to one.
            if b"\n\n" in pending:
                self._separator = b"\n\n"
            elif b"\r\n\r\n" in pending:
                self._separator = b"\r\n\r\n"
            else:
                self._pending = pending
                return
        *events, self._pending = pending.split(self._separator)
        for event in events:
            payload: bytes | None = event[6:]
            if not event.startswith(b"data: ") or b"\n" in event:
                payload = _event_data(event)
            if payload is not None and not self.on_event(payload, arrived):
                self.on_event = _ignore


def _ignore(_data: bytes, _arrived: float) -> bool:
    return True


def _event_data(event: bytes) -> bytes | None:
    """The data of an event with several lines or unusual spacing; None when it has none."""
    fields = []
    for line in event.replace(b"\r\n", b"\n").split(b"\n"):
        if line.startswith(b"data:"):
            value = line[5:]
            fields.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(fields) if fields else None


async def _read_chunked(reader: asyncio.StreamReader, events: _EventSplitter) -> None:
    """Read a chunked body to its end, feeding each read's complete chunks to `events`."""
    buffer = b""
    while True:
        data = await reader.read(_READ_SIZE)
        if not data:
            raise asyncio.IncompleteReadError(buffer, None)
        arrived = time.perf_counter()
        buffer += data
        body: list[bytes] = []
        position = 0
        while True:
            line_end = buffer.find(b"\r\n", position)
            if line_end < 0:
                break
            # A chunk-size line may carry extensions after ';', which mean nothing here.
            size = int(buffer[position:line_end].split(b";", 1)[0], 16)
            if size == 0:
                # The last chunk: its size line, optional trailer fields, then an empty line.
                if buffer.find(b"\r\n\r\n", line_end) < 0:
                    break
                events.feed(b"".join(body), arrived)
                return
            chunk_end = line_end + 2 + size
            if len(buffer) < chunk_end + 2:
                break
            body.append(buffer[line_end + 2 : chunk_end])
            position = chunk_end + 2
        buffer = buffer[position:]
        if body:
            events.feed(b"".join(body), arrived)
