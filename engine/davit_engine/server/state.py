"""The server's shared state: engine client, tokenizer, metrics, readiness and drain.

Readiness contract: `/ready` is 200 only while the model is loaded, the core runs and no drain
has begun. Drain contract: after `begin_drain()`, new generation requests get 503 and in-flight
ones run to completion; `drain(timeout)` waits for them, and when the timeout passes it ends the
rest itself: each open stream gets a last chunk with finish reason "abort" and an error event
(a JSON request answers 503), instead of a connection cut without a word.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from davit_engine.config import EngineConfig
from davit_engine.ipc.request_stream import RequestStream
from davit_engine.server.errors import OpenAIError
from davit_engine.server.metrics import CacheConfig, ServerMetrics
from davit_engine.server.preparation import PromptPreparer
from davit_engine.tokenizer import Tokenizer
from davit_engine.types import EngineRequest, EngineStats, ParamError

if TYPE_CHECKING:
    from davit_engine.server.generation import Generation

logger = logging.getLogger(__name__)

# After the drain timeout ended the open requests, how long their handlers get to write the
# last events before the server closes the connections.
_CUT_OFF_GRACE_S = 2.0


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


# Large enough for a long-context prompt: a 1M-token context as text (about 4 MB) or as token
# ids in JSON (about 7 MB), with room for several prompts in one request.
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class ServerSettings:
    """Front-end settings that are not engine configuration."""

    host: str = "127.0.0.1"
    port: int = 8000
    drain_timeout_s: float = 30.0
    startup_timeout_s: float | None = None  # None: wait for the model as long as it takes
    # Bearer key every route but /health, /ready and /metrics requires; None: open. Kept out
    # of the repr so that logging the settings never shows it.
    api_key: str | None = field(default=None, repr=False)
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES  # larger bodies: 413
    # A client gets this long to send a request's headers (from connecting, or from the end
    # of its previous response) and, separately, its whole body; then it is dropped.
    request_read_timeout_s: float = 60.0
    # Whether special-token text inside chat message content is parsed as control tokens.
    allow_special_tokens_in_content: bool = False


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
        self.metrics = ServerMetrics(
            self.model_name,
            CacheConfig(
                block_size=config.block_size,
                cache_dtype=config.kv_cache_dtype,
                enable_prefix_caching=config.enable_prefix_caching,
            ),
        )
        self.loaded = False
        self.load_error: str | None = None
        self.draining = False
        self.num_in_flight = 0
        self.cut_off_reason: str | None = None  # set when the drain timeout ended requests
        self.preparer = PromptPreparer()
        self._live: set[Generation] = set()
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

    def check_capacity(self, num_choices: int, param: str) -> None:
        """Refuse (ParamError naming `param`) a request whose choices could never all be
        admitted, however long the client waited: a 400 that says why, not a 429 forever."""
        queue = self.config.max_queue_len
        if queue is None:
            return  # an unbounded queue admits any number
        capacity = self.config.max_num_seqs + queue
        if num_choices > capacity:
            raise ParamError(
                param,
                f"this request needs {num_choices} sequences at once (prompts x n), and this "
                f"server admits at most {capacity} (--max-num-seqs {self.config.max_num_seqs} "
                f"plus --max-queue-len {queue}); ask for fewer choices or send fewer prompts",
            )

    # --- in-flight accounting and drain ---------------------------------------------------

    def begin_request(self) -> None:
        self.num_in_flight += 1
        self._idle.clear()

    def end_request(self) -> None:
        self.num_in_flight -= 1
        assert self.num_in_flight >= 0, "end_request without begin_request"
        if self.num_in_flight == 0:
            self._idle.set()

    def track(self, generation: Generation) -> None:
        """Remember an admitted generation until `untrack`, so a drain can end it."""
        self._live.add(generation)
        if self.cut_off_reason is not None:
            generation.cut_off(self.cut_off_reason)

    def untrack(self, generation: Generation) -> None:
        self._live.discard(generation)

    async def drain(self, timeout_s: float) -> bool:
        """Begin the drain and wait for the in-flight requests (True when they all finished
        within `timeout_s`); then end the rest, as the module says."""
        self.begin_drain()
        if await self.wait_drained(timeout_s):
            return True
        self.cut_off_reason = (
            f"the server shut down before this request finished (the drain timeout of "
            f"{timeout_s:g} s passed); retry it on another replica"
        )
        for generation in list(self._live):
            generation.cut_off(self.cut_off_reason)
        await self.wait_drained(_CUT_OFF_GRACE_S)
        return False

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
                "%g s passed with %d request(s) in flight", timeout_s, self.num_in_flight
            )
            return False
