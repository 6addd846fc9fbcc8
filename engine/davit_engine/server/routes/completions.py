"""POST /v1/completions: JSON or server-sent events."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from davit_engine.server.generation import Generation, admit
from davit_engine.server.output import LogprobEntry
from davit_engine.server.prompts import completion_prompt_ids
from davit_engine.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
)
from davit_engine.server.routes.common import (
    collect_unless_disconnected,
    event_stream,
    get_state,
    sse_event,
    usage_of,
)
from davit_engine.server.sampling import sampling_params

router = APIRouter()

_ERRORS: dict[int | str, dict[str, object]] = {
    code: {"model": ErrorResponse} for code in (400, 404, 429, 500, 503)
}


def completion_logprobs(entries: list[LogprobEntry], text_offset: int) -> CompletionLogprobs:
    """OpenAI's legacy logprobs block; offsets count from the start of the completion."""
    result = CompletionLogprobs()
    for entry in entries:
        result.tokens.append(entry.token)
        result.token_logprobs.append(entry.logprob)
        result.top_logprobs.append(dict(entry.top) if entry.top else None)
        result.text_offset.append(text_offset)
        text_offset += len(entry.token)
    return result


@router.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = get_state(request)
    state.check_model(body.model)
    state.check_accepting()
    prompt_ids = completion_prompt_ids(body, state.tokenizer)
    sampling = sampling_params(
        body, len(prompt_ids), state.max_model_len, state.config.max_logprobs
    )
    generation = await admit(state, prompt_ids, sampling, "cmpl")
    want_logprobs = body.logprobs is not None
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return event_stream(generation, _chunks(generation, want_logprobs, include_usage))

    async def collect() -> CompletionResponse:
        text: list[str] = []
        entries: list[LogprobEntry] = []
        async for piece in generation.pieces():
            text.append(piece.text)
            entries.extend(piece.logprobs)
        return CompletionResponse(
            id=generation.request_id,
            created=generation.created,
            model=state.model_name,
            choices=[
                CompletionChoice(
                    text="".join(text),
                    logprobs=completion_logprobs(entries, 0) if want_logprobs else None,
                    finish_reason=generation.output.finish_reason,
                )
            ],
            usage=usage_of(generation),
        )

    result = await collect_unless_disconnected(request, generation, collect)
    if result is None:
        return Response(status_code=499)  # nobody is listening; the request was aborted
    return JSONResponse(result.model_dump(mode="json"))


async def _chunks(
    generation: Generation, logprobs: bool, include_usage: bool
) -> AsyncIterator[bytes]:
    def chunk(choice: CompletionChoice | None) -> CompletionResponse:
        return CompletionResponse(
            id=generation.request_id,
            created=generation.created,
            model=generation.state.model_name,
            choices=[choice] if choice is not None else [],
        )

    offset = 0
    async for piece in generation.pieces():
        if not piece.text and not piece.logprobs and piece.finish_reason is None:
            continue
        block = completion_logprobs(piece.logprobs, offset) if logprobs else None
        offset += sum(len(e.token) for e in piece.logprobs)
        yield sse_event(
            chunk(
                CompletionChoice(text=piece.text, logprobs=block, finish_reason=piece.finish_reason)
            )
        )
    if include_usage:
        final = chunk(None)
        final.usage = usage_of(generation)
        yield sse_event(final)
