"""The FastAPI app factory. Nothing loads at import; the model loads in the lifespan.

Startup contract: the lifespan starts loading (engine-core process and tokenizer) in the
background and returns at once, so `/health` and `/ready` answer while the model loads (`/ready`
is 503 until it is done). A load failure is reported through `on_fatal` (the CLI exits non-zero)
and leaves `/health` at 503. Shutdown stops the engine-core process.

Middleware, outermost first: the status counter (every answer is counted, refusals of the
others included), the internal-error guard (unexpected exceptions become a logged 500 without
internals), the API key (401 before anything is read), the body limits (413, 408).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI

import davit_engine
from davit_engine.config import EngineConfig
from davit_engine.ipc.client import AsyncEngineClient
from davit_engine.ipc.core_process import DEFAULT_CORE_FACTORY
from davit_engine.ipc.errors import EngineDeadError
from davit_engine.server.auth import APIKeyMiddleware
from davit_engine.server.connections import RequestBodyLimits
from davit_engine.server.errors import InternalErrorMiddleware, install_error_handlers
from davit_engine.server.metrics import HTTPStatusMiddleware
from davit_engine.server.routes import chat, completions, ops
from davit_engine.server.state import ServerSettings, ServerState
from davit_engine.tokenizer import Tokenizer
from davit_engine.types import ParamError

logger = logging.getLogger(__name__)

TokenizerLoader = Callable[[EngineConfig], Tokenizer]


def _default_tokenizer_loader(config: EngineConfig) -> Tokenizer:
    from davit_engine.tokenizer import load_tokenizer

    return load_tokenizer(config)


def create_app(
    config: EngineConfig,
    settings: ServerSettings | None = None,
    *,
    core_factory: str = DEFAULT_CORE_FACTORY,
    tokenizer_loader: TokenizerLoader = _default_tokenizer_loader,
    on_fatal: Callable[[str], None] | None = None,
) -> FastAPI:
    """Build the app for `config`.

    `core_factory` ("module:attribute") builds the engine core inside the core process; tests
    pass a fake one. `on_fatal(reason)` is called if the model fails to load.
    """
    settings = settings or ServerSettings()
    client = AsyncEngineClient(config, core_factory)
    state = ServerState(config, settings, client, tokenizer=None)

    async def load() -> None:
        tokenizer_task = asyncio.create_task(asyncio.to_thread(tokenizer_loader, config))
        try:
            await client.start(settings.startup_timeout_s)
            state.set_tokenizer(await tokenizer_task)
        except (EngineDeadError, ParamError, TimeoutError) as exc:
            # The message names what to fix (flag or file); a traceback would only bury it.
            fail(str(exc) if not isinstance(exc, ParamError) else f"{exc.param}: {exc.message}")
        except Exception as exc:  # reported on /health and to on_fatal, never swallowed
            logger.exception("the model failed to load")
            fail(f"{type(exc).__name__}: {exc}")
        else:
            state.loaded = True
            logger.info(
                "serving %s (max_model_len %s)",
                state.model_name,
                client.model_info.get("max_model_len"),
            )
        finally:
            if not tokenizer_task.done():
                tokenizer_task.cancel()
            # Its outcome is part of the failure already reported, if any.
            await asyncio.gather(tokenizer_task, return_exceptions=True)

    def fail(reason: str) -> None:
        state.load_error = reason
        logger.error("the model failed to load: %s", reason)
        if on_fatal is not None:
            on_fatal(reason)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(load(), name="davit-load-model")
        try:
            yield
        finally:
            loader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loader
            state.preparer.shutdown()
            await client.shutdown()

    app = FastAPI(title="Davit engine", version=davit_engine.__version__, lifespan=lifespan)
    app.state.davit = state
    install_error_handlers(app)
    routers = (chat.router, completions.router, ops.router)
    for router in routers:
        app.include_router(router)
    # Each add_middleware wraps what was added before: the last one added runs first.
    app.add_middleware(
        RequestBodyLimits,
        max_bytes=settings.max_request_body_bytes,
        timeout_s=settings.request_read_timeout_s,
    )
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(InternalErrorMiddleware)
    routes = frozenset(
        str(route.path) for router in routers for route in router.routes if hasattr(route, "path")
    )
    app.add_middleware(HTTPStatusMiddleware, metrics=lambda: state.metrics, routes=routes)
    return app
