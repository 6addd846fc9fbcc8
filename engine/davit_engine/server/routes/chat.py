"""POST /v1/chat/completions: JSON or server-sent events."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from davit_engine.server.generation import Generation, admit
from davit_engine.server.output import LogprobEntry
from davit_engine.server.prompts import chat_prompt_ids
from davit_engine.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    DeltaMessage,
    ErrorResponse,
    TopLogprob,
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


def chat_logprobs(entries: list[LogprobEntry]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=e.token,
                logprob=e.logprob,
                bytes=list(e.token.encode()),
                top_logprobs=[
                    TopLogprob(token=t, logprob=lp, bytes=list(t.encode())) for t, lp in e.top
                ],
            )
            for e in entries
        ]
    )


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = get_state(request)
    state.check_model(body.model)
    state.check_accepting()
    prompt_ids = chat_prompt_ids(body, state.tokenizer)
    sampling = sampling_params(
        body, len(prompt_ids), state.max_model_len, state.config.max_logprobs
    )
    generation = await admit(state, prompt_ids, sampling, "chatcmpl")
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return event_stream(generation, _chunks(generation, body.logprobs, include_usage))

    async def collect() -> ChatCompletionResponse:
        text: list[str] = []
        entries: list[LogprobEntry] = []
        async for piece in generation.pieces():
            text.append(piece.text)
            entries.extend(piece.logprobs)
        return ChatCompletionResponse(
            id=generation.request_id,
            created=generation.created,
            model=state.model_name,
            choices=[
                ChatChoice(
                    message=AssistantMessage(content="".join(text)),
                    logprobs=chat_logprobs(entries) if body.logprobs else None,
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
    def chunk(choice: ChatChunkChoice | None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=generation.request_id,
            created=generation.created,
            model=generation.state.model_name,
            choices=[choice] if choice is not None else [],
        )

    yield sse_event(chunk(ChatChunkChoice(delta=DeltaMessage(role="assistant", content=""))))
    async for piece in generation.pieces():
        if not piece.text and not piece.logprobs and piece.finish_reason is None:
            continue
        yield sse_event(
            chunk(
                ChatChunkChoice(
                    delta=DeltaMessage(content=piece.text),
                    logprobs=chat_logprobs(piece.logprobs) if logprobs else None,
                    finish_reason=piece.finish_reason,
                )
            )
        )
    if include_usage:
        final = chunk(None)
        final.usage = usage_of(generation)
        yield sse_event(final)
