"""POST /v1/completions: JSON or server-sent events; several prompts and `n` give choices."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response

from davit_engine.output.processor import LogprobEntry
from davit_engine.server.generation import Choices, admit_choices
from davit_engine.server.preparation import prompt_size
from davit_engine.server.prompts import completion_prompts
from davit_engine.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
)
from davit_engine.server.routes.common import (
    ChunkEncoder,
    Finished,
    event_stream,
    get_state,
    respond_when_finished,
    usage_of,
)
from davit_engine.server.sampling import sampling_params

router = APIRouter()

_ERRORS: dict[int | str, dict[str, object]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 413, 429, 500, 503)
}


def completion_logprobs(entries: list[LogprobEntry], text_offset: int) -> dict[str, Any]:
    """OpenAI's legacy logprobs block (a `CompletionLogprobs` as plain data), one entry per
    token; offsets count from the start of the completion, `text_offset` is the first's."""
    offsets = []
    for entry in entries:
        offsets.append(text_offset)
        text_offset += len(entry.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) if e.top else None for e in entries],
        "text_offset": offsets,
    }


@router.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = get_state(request)
    state.check_model(body.model)
    state.check_accepting()
    body.check()
    prompts = await state.preparer.run(prompt_size(body), completion_prompts, body, state.tokenizer)
    max_model_len, max_logprobs = state.max_model_len, state.config.max_logprobs
    samplings = [sampling_params(body, len(p), max_model_len, max_logprobs) for p in prompts]
    choices = await admit_choices(state, body, prompts, samplings, "cmpl")
    want_logprobs = body.logprobs is not None
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return event_stream(choices, _chunks(choices, want_logprobs, include_usage))

    def build(done: dict[int, Finished]) -> CompletionResponse:
        return CompletionResponse(
            id=choices.id,
            created=choices.created,
            model=state.model_name,
            choices=[
                CompletionChoice(
                    index=g.index,
                    text=done[g.index].text,
                    logprobs=(
                        CompletionLogprobs.model_validate(
                            completion_logprobs(done[g.index].logprobs, 0)
                        )
                        if want_logprobs
                        else None
                    ),
                    finish_reason=g.output.finish_reason,
                )
                for g in choices.generations
            ],
            usage=usage_of(choices),
        )

    return await respond_when_finished(request, choices, build)


async def _chunks(choices: Choices, logprobs: bool, include_usage: bool) -> AsyncIterator[bytes]:
    """One `CompletionResponse` chunk event per piece (all tokens that arrived together)."""
    model = choices.generations[0].state.model_name
    encoder = ChunkEncoder("text_completion", choices.id, choices.created, model)
    offsets = {g.index: 0 for g in choices.generations}
    async for generation, piece in choices.pieces():
        if not piece.text and not piece.logprobs and piece.finish_reason is None:
            continue
        index = generation.index
        block = completion_logprobs(piece.logprobs, offsets[index]) if logprobs else None
        offsets[index] += sum(len(e.token) for e in piece.logprobs)
        yield encoder.event(
            [
                {
                    "index": index,
                    "text": piece.text,
                    "logprobs": block,
                    "finish_reason": piece.finish_reason,
                }
            ]
        )
    if include_usage:
        yield encoder.event([], usage_of(choices))
