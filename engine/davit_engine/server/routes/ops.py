"""Operational endpoints: health, readiness, metrics, the model list and engine info."""

from __future__ import annotations

import dataclasses
import time

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from davit_engine.ipc.errors import EngineDeadError
from davit_engine.server.errors import OpenAIError, error_response
from davit_engine.server.protocol import ModelCard, ModelList
from davit_engine.server.routes.common import get_state

router = APIRouter()

_STARTED = int(time.time())


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while the engine core is loading or running; 503 once it failed or died."""
    state = get_state(request)
    if state.load_error is not None:
        return error_response(503, f"the model failed to load: {state.load_error}")
    if state.loaded and not state.client.is_alive:
        return error_response(503, f"the engine is not running: {state.client.dead_reason}")
    return JSONResponse({"status": "ok" if state.loaded else "loading"})


@router.get("/ready")
async def ready(request: Request) -> Response:
    """200 only when new requests are admitted: loaded, core alive, not draining."""
    state = get_state(request)
    if state.is_ready:
        return JSONResponse({"ready": True})
    if state.draining:
        reason = "draining"
    elif state.load_error is not None or (state.loaded and not state.client.is_alive):
        reason = "engine not running"
    else:
        reason = "loading"
    return JSONResponse({"ready": False, "reason": reason}, status_code=503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = get_state(request)
    # The core reports its state after every step: a scrape never waits for a long step.
    if state.client.latest_stats is not None:
        state.metrics.set_engine_stats(state.client.latest_stats)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    state = get_state(request)
    max_model_len = state.model_info.get("max_model_len") if state.loaded else None
    card = ModelCard(
        id=state.model_name, created=_STARTED, root=state.config.model, max_model_len=max_model_len
    )
    return ModelList(data=[card])


@router.get("/v1/engine/profile")
async def engine_profile(request: Request) -> Response:
    """The memory profile the engine core measured at startup (davit_engine.memory)."""
    state = get_state(request)
    if not state.loaded:
        raise OpenAIError(503, "the model is still loading")
    profile = state.model_info.get("memory_profile")
    if profile is None:
        raise OpenAIError(404, "this engine started without a memory profile")
    return JSONResponse(profile)


@router.get("/v1/engine/info")
async def engine_info(request: Request) -> Response:
    """The core's ModelInfo (blocks, dtype, device, runner and why it was picked) and stats.

    The stats are fresh: asked from the core, answered between two steps.
    """
    state = get_state(request)
    if not state.loaded:
        raise OpenAIError(503, "the model is still loading")
    try:
        stats = await state.client.get_stats(timeout_s=60.0)
    except TimeoutError as exc:
        raise OpenAIError(503, "the engine core did not answer within 60 s") from exc
    except EngineDeadError as exc:
        raise OpenAIError(503, f"the engine is not running: {exc}") from exc
    return JSONResponse(
        {
            "model_info": state.model_info,
            "stats": dataclasses.asdict(stats),
            "num_in_flight": state.num_in_flight,
        }
    )
