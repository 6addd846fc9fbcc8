"""The streaming client of `davit bench serve`: SSE framing, connection reuse, endpoint checks."""

from __future__ import annotations

import asyncio

import pytest

from davit_engine.bench.sse_client import (
    ConnectionPool,
    Endpoint,
    HTTPStatusError,
    SSEConnection,
)


def _chunk(piece: bytes, extension: bytes = b"") -> bytes:
    return b"%x%s\r\n%s\r\n" % (len(piece), extension, piece)


# Raw HTTP/1.1 responses a server may send, one per request on one keep-alive connection.
RESPONSES = [
    # Chunked SSE with LF line ends: one event split over two chunks (the second with a chunk
    # extension), two events in one chunk, a comment, an event of two data lines.
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    + _chunk(b'data: {"a":')
    + _chunk(b"1}\n\n", b";ext=1")
    + _chunk(b": keep-alive\n\ndata: two\n\ndata:x\ndata: y\n\n")
    + b"0\r\n\r\n",
    # CRLF line ends, sized by Content-Length.
    b"HTTP/1.1 200 OK\r\ncontent-length: 29\r\n\r\ndata: one\r\n\r\ndata: [DONE]\r\n\r\n",
    # An error status: its body is the detail, the connection stays usable.
    b"HTTP/1.1 404 Not Found\r\ncontent-length: 9\r\n\r\nno model!",
    # No framing: the body ends when the server closes the connection.
    b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\ndata: last\n\n",
]


def test_sse_client_reads_every_framing_and_keeps_the_connection() -> None:
    requests: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for response in RESPONSES:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            requests.append(head + await reader.readexactly(length))
            writer.write(response)
            await writer.drain()
        writer.close()

    async def scenario() -> list[list[bytes]]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        connection = SSEConnection(Endpoint.from_url(f"http://127.0.0.1:{port}/api/"))
        seen: list[list[bytes]] = []
        for _ in RESPONSES:
            events: list[bytes] = []

            def on_event(data: bytes, _arrived: float, events: list[bytes] = events) -> bool:
                events.append(data)
                return True

            try:
                await connection.post("/v1/x", {"n": 1}, on_event)
            except HTTPStatusError as exc:
                events.append(f"{exc.status} {exc.detail}".encode())
            seen.append(events)
        connection.close()
        server.close()
        await server.wait_closed()
        return seen

    seen = asyncio.run(scenario())
    assert seen == [
        [b'{"a":1}', b"two", b"x\ny"],
        [b"one", b"[DONE]"],
        [b"404 no model!"],
        [b"last"],
    ]
    # Every request went over the one connection, to the path under the URL's prefix.
    assert len(requests) == 4
    assert all(r.startswith(b"POST /api/v1/x HTTP/1.1\r\n") for r in requests)
    assert all(r.endswith(b'{"n": 1}') for r in requests)


def test_connection_pool_reuses_idle_connections_and_drops_broken_ones() -> None:
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            body = await reader.readexactly(length)
            if b"break" in body:
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\ndata")
                break
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\ndata: 1\n")
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = ConnectionPool(Endpoint.from_url(f"http://127.0.0.1:{port}"))
        for _ in range(3):
            await pool.post("/", {}, lambda _d, _t: True)
        with pytest.raises(asyncio.IncompleteReadError):
            await pool.post("/", {"break": 1}, lambda _d, _t: True)
        await pool.post("/", {}, lambda _d, _t: True)
        pool.close()
        server.close()
        await server.wait_closed()

    asyncio.run(scenario())
    # Three requests on the first connection; it broke, so the last one opened a second.
    assert connections == 2


@pytest.mark.parametrize("url", ["localhost:8000", "ftp://127.0.0.1/", "http://"])
def test_endpoint_rejects_what_is_not_an_http_url(url: str) -> None:
    with pytest.raises(ValueError, match="not an http:// or https:// URL"):
        Endpoint.from_url(url)
