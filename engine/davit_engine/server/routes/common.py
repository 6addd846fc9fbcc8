"""Helpers the generation routers share: state lookup, SSE framing, usage, collection."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from fastapi.sse import EventSourceResponse, format_sse_event
from pydantic import BaseModel
from pydantic_core import to_json
from starlette.background import BackgroundTask

from davit_engine.output.processor import LogprobEntry
from davit_engine.server.errors import OpenAIError, error_payload, log_internal_error
from davit_engine.server.generation import Choices
from davit_engine.server.protocol import PromptTokensDetails, Usage
from davit_engine.server.state import ServerState

T = TypeVar("T")

DONE = format_sse_event(data_str="[DONE]")


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.davit
    return state


def usage_of(choices: Choices) -> Usage:
    prompt, completion, cached = choices.usage_counts()
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


class ChunkEncoder:
    """Encodes the chunks of one streamed response as SSE events, one JSON encoding each.

    A chunk is built as plain data in exactly the shape of the route's pydantic chunk model
    (`ChatCompletionChunk`, `CompletionResponse`): every field, nulls included, in the
    model's order. Chunks go out once per batch of tokens, and building and validating models
    for each of them would cost more than everything else the stream does; the tests check
    that every encoded chunk parses into the model and dumps back to the same data.
    """

    def __init__(self, object_name: str, response_id: str, created: int, model: str) -> None:
        self.object_name = object_name
        self.response_id = response_id
        self.created = created
        self.model = model

    def event(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> bytes:
        chunk = {
            "id": self.response_id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage.model_dump() if usage is not None else None,
        }
        return format_sse_event(data_str=to_json(chunk).decode())


def sse_error(error: OpenAIError) -> bytes:
    body = error_payload(error.status_code, error.message, error.param)
    return format_sse_event(data_str=json.dumps(body))


def event_stream(choices: Choices, events: AsyncIterator[bytes]) -> EventSourceResponse:
    """Stream already-framed SSE events; the request is closed (aborted if unfinished) after.

    One route answers both JSON and SSE depending on the body's `stream`, and admission errors
    must keep their status code, so this is a plain route returning FastAPI's
    EventSourceResponse with FastAPI's own event framing, not a generator route. An error
    mid-stream ends it with an error event (and [DONE]), never with a cut connection. The
    background task runs after the stream ends and also when starlette cancels the stream on a
    client disconnect, even if it was cancelled before its first event.
    """

    async def body() -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield event
        except OpenAIError as exc:
            yield sse_error(exc)
        except Exception as exc:  # logged with its traceback; the client gets the error id
            yield sse_error(log_internal_error("POST", "(stream)", exc))
        finally:
            choices.close()
        yield DONE

    async def close() -> None:
        # A coroutine, so starlette runs it on the event loop, not in a worker thread.
        choices.close()

    response = EventSourceResponse(body(), background=BackgroundTask(close))
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Accel-Buffering"] = "no"
    return response


async def collect_unless_disconnected(
    request: Request, choices: Choices, collect: Callable[[], Awaitable[T]]
) -> T | None:
    """Run `collect()` unless the client leaves first (then abort and return None)."""

    async def wait_for_disconnect() -> None:
        # The body has been read already, so the next ASGI message can only be the disconnect,
        # which the server delivers as soon as the socket closes.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(collect())
    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        return None
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
        choices.close()


@dataclass
class Finished:
    """One generation's whole output."""

    text: str
    logprobs: list[LogprobEntry]


async def respond_when_finished(
    request: Request, choices: Choices, build: Callable[[dict[int, Finished]], BaseModel]
) -> Response:
    """Gather every generation's text and logprob entries, then answer with `build(...)` as
    JSON; 499 (and the generations aborted) when the client leaves first."""

    async def collect() -> BaseModel:
        entries: dict[int, list[LogprobEntry]] = {g.index: [] for g in choices.generations}
        async for generation, piece in choices.pieces():
            entries[generation.index].extend(piece.logprobs)
        return build(
            {g.index: Finished(g.output.text, entries[g.index]) for g in choices.generations}
        )

    result = await collect_unless_disconnected(request, choices, collect)
    if result is None:
        return Response(status_code=499)  # nobody is listening; the request was aborted
    return JSONResponse(result.model_dump(mode="json"))
