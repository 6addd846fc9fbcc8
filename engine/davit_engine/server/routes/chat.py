"""POST /v1/chat/completions: JSON or server-sent events."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response

from davit_engine.output.processor import LogprobEntry
from davit_engine.server.generation import Choices, admit_choices
from davit_engine.server.preparation import prompt_size
from davit_engine.server.prompts import chat_prompt_ids
from davit_engine.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
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


def chat_logprobs(entries: list[LogprobEntry]) -> dict[str, Any]:
    """A `ChatLogprobs` as plain data: one content entry per token, in order."""
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": list(e.token.encode()),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in e.top
                ],
            }
            for e in entries
        ]
    }


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = get_state(request)
    state.check_model(body.model)
    state.check_accepting()
    body.check()
    prompt_ids = await state.preparer.run(
        prompt_size(body),
        chat_prompt_ids,
        body,
        state.tokenizer,
        state.settings.allow_special_tokens_in_content,
    )
    sampling = sampling_params(
        body, len(prompt_ids), state.max_model_len, state.config.max_logprobs
    )
    choices = await admit_choices(state, body, [prompt_ids], [sampling], "chatcmpl")
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return event_stream(choices, _chunks(choices, body.logprobs, include_usage))

    def build(done: dict[int, Finished]) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=choices.id,
            created=choices.created,
            model=state.model_name,
            choices=[
                ChatChoice(
                    index=g.index,
                    message=AssistantMessage(content=done[g.index].text),
                    logprobs=(
                        ChatLogprobs.model_validate(chat_logprobs(done[g.index].logprobs))
                        if body.logprobs
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
    """One `ChatCompletionChunk` event per piece (all tokens that arrived together)."""
    model = choices.generations[0].state.model_name
    encoder = ChunkEncoder("chat.completion.chunk", choices.id, choices.created, model)
    for generation in choices.generations:
        yield encoder.event(
            [
                {
                    "index": generation.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )
    async for generation, piece in choices.pieces():
        if not piece.text and not piece.logprobs and piece.finish_reason is None:
            continue
        yield encoder.event(
            [
                {
                    "index": generation.index,
                    "delta": {"role": None, "content": piece.text},
                    "logprobs": chat_logprobs(piece.logprobs) if logprobs else None,
                    "finish_reason": piece.finish_reason,
                }
            ]
        )
    if include_usage:
        yield encoder.event([], usage_of(choices))
