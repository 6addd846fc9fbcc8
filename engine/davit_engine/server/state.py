"""The server's shared state: engine client, tokenizer, metrics, readiness and drain.

Readiness contract: `/ready` is 200 only while the model is loaded, the core runs and no drain
has begun. Drain contract: after `begin_drain()`, new generation requests get 503, in-flight
ones run to completion, and `wait_drained(timeout)` returns once none is left (aborting the rest
when the timeout passes).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from davit_engine.config import EngineConfig
from davit_engine.ipc.request_stream import RequestStream
from davit_engine.server.errors import OpenAIError
from davit_engine.server.metrics import ServerMetrics
from davit_engine.tokenizer import Tokenizer
from davit_engine.types import EngineRequest, EngineStats

logger = logging.getLogger(__name__)


class EngineClientLike(Protocol):
    """What the routes need from `davit_engine.ipc.client.AsyncEngineClient`."""

    model_info: dict[str, Any]
    dead_reason: str | None
    latest_stats: EngineStats | None

    @property
    def is_alive(self) -> bool: ...

    async def add_request(self, request: EngineRequest) -> RequestStream: ...

    def abort(self, request_id: str) -> None: ...

    def release(self, request_id: str) -> None: ...

    async def get_stats(self, timeout_s: float = 5.0) -> EngineStats: ...


@dataclass(frozen=True)
class ServerSettings:
    """Front-end settings that are not engine configuration."""

    host: str = "127.0.0.1"
    port: int = 8000
    drain_timeout_s: float = 30.0
    startup_timeout_s: float | None = None  # None: wait for the model as long as it takes


class ServerState:
    def __init__(
        self,
        config: EngineConfig,
        settings: ServerSettings,
        client: EngineClientLike,
        tokenizer: Tokenizer | None,
    ) -> None:
        self.config = config
        self.settings = settings
        self.client = client
        self._tokenizer = tokenizer
        self.model_name = config.model_name
        self.metrics = ServerMetrics(self.model_name)
        self.loaded = False
        self.load_error: str | None = None
        self.draining = False
        self.num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    # --- model ----------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise OpenAIError(503, "the model is still loading")
        return self._tokenizer

    def set_tokenizer(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    @property
    def model_info(self) -> dict[str, Any]:
        return self.client.model_info

    @property
    def max_model_len(self) -> int:
        value = self.model_info.get("max_model_len") or self.config.max_model_len
        if value is None:
            raise OpenAIError(503, "the model is still loading")
        return int(value)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = self.model_info.get("eos_token_ids")
        if ids is None and self._tokenizer is not None:
            ids = self._tokenizer.eos_token_ids
        return tuple(int(i) for i in ids or ())

    def check_model(self, requested: str | None) -> None:
        """Unknown model names are 404, as OpenAI answers them."""
        if requested is not None and requested not in (self.model_name, self.config.model):
            raise OpenAIError(
                404,
                f"the model '{requested}' does not exist; this server serves '{self.model_name}'",
                "model",
            )

    # --- readiness ------------------------------------------------------------------------

    @property
    def is_ready(self) -> bool:
        return self.loaded and self.client.is_alive and not self.draining

    def check_accepting(self) -> None:
        """Raise OpenAIError(503) unless a new request may be admitted now."""
        if self.draining:
            raise OpenAIError(503, "the server is shutting down; retry on another replica")
        if self.load_error is not None:
            raise OpenAIError(503, f"the model failed to load: {self.load_error}")
        if not self.loaded:
            raise OpenAIError(503, "the model is still loading; retry shortly")
        if not self.client.is_alive:
            raise OpenAIError(503, f"the engine is not running: {self.client.dead_reason}")

    # --- in-flight accounting and drain ---------------------------------------------------

    def begin_request(self) -> None:
        self.num_in_flight += 1
        self._idle.clear()

    def end_request(self) -> None:
        self.num_in_flight -= 1
        assert self.num_in_flight >= 0, "end_request without begin_request"
        if self.num_in_flight == 0:
            self._idle.set()

    def begin_drain(self) -> None:
        if not self.draining:
            logger.info("draining: %d request(s) in flight", self.num_in_flight)
        self.draining = True

    async def wait_drained(self, timeout_s: float) -> bool:
        """True when every in-flight request finished within `timeout_s`."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            logger.warning(
                "drain timeout (%.0f s) passed with %d request(s) in flight; aborting them",
                timeout_s,
                self.num_in_flight,
            )
            return False
