"""One admitted request's deltas on their way from the engine client to the HTTP handler."""

from __future__ import annotations

import asyncio

from davit_engine.types import RequestDelta


class RequestStream:
    """Deltas for one admitted request, in order; an error (`EngineDeadError` when the core
    died, or the front end's own reason to stop) ends it early.

    The client `put()`s deltas as they arrive; the consumer `take()`s everything that arrived
    since its last call, so a consumer that fell behind catches up in one step instead of one
    wake-up per delta.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._pending: list[RequestDelta] = []
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None

    def put(self, delta: RequestDelta) -> None:
        self._pending.append(delta)
        self._wake()

    def fail(self, error: Exception) -> None:
        """End the stream with `error` once the deltas already put have been taken."""
        self._error = error
        self._wake()

    async def take(self) -> list[RequestDelta]:
        """Every delta not taken yet (at least one; waits for it). Raises the stream's error."""
        while not self._pending:
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        pending, self._pending = self._pending, []
        return pending

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
