"""Streamed chunks carrying several tokens: exact text, usage, per-token logprobs, choices.

The encoder's plain-data chunks must be exactly the protocol models; the routes' chunk
generators must keep everything per token when deltas are merged; and end to end (the real app
and core process, with the benchmark's core emitting several tokens per step) the official
openai client must read the same text, usage and logprobs as without merging.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from davit_engine.config import EngineConfig
from davit_engine.ipc.request_stream import RequestStream
from davit_engine.output.processor import OutputProcessor
from davit_engine.server.app import create_app
from davit_engine.server.generation import Choices, Generation
from davit_engine.server.protocol import (
    ChatCompletionChunk,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
)
from davit_engine.server.routes import chat, completions
from davit_engine.server.routes.common import ChunkEncoder
from davit_engine.server.state import ServerSettings, ServerState
from davit_engine.tokenizer import ByteTokenizer
from davit_engine.types import FinishReason, RequestDelta, SamplingParams, TokenLogprob
from davit_tools.bench.api_stream import SCRIPT, TOKENS_PER_STEP_ENV

from .conftest import FakeServer, byte_tokenizer
from .harness import threaded_server
from .test_generation import RecordingClient

MODEL = "stream-model"


def events_of(raw: list[bytes]) -> list[dict[str, Any]]:
    """The JSON chunks of SSE events (each `data: ...` event, `[DONE]` excluded)."""
    chunks = []
    for event in raw:
        text = event.decode()
        assert text.startswith("data: ") and text.endswith("\n\n"), text
        chunks.append(json.loads(text.removeprefix("data: ")))
    return chunks


# --- the encoder --------------------------------------------------------------------------------


def test_encoded_chunks_are_exactly_the_protocol_models() -> None:
    encoder = ChunkEncoder("chat.completion.chunk", "chatcmpl-1", 123, "m")
    choice = {
        "index": 1,
        "delta": {"role": None, "content": 'a"b\n\u00e9'},
        "logprobs": {
            "content": [
                {
                    "token": "a",
                    "logprob": -0.5,
                    "bytes": [97],
                    "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]}],
                }
            ]
        },
        "finish_reason": "length",
    }
    usage = Usage(
        prompt_tokens=3,
        completion_tokens=4,
        total_tokens=7,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=1),
    )
    for data in events_of([encoder.event([choice]), encoder.event([], usage)]):
        assert ChatCompletionChunk.model_validate(data).model_dump() == data
    encoder = ChunkEncoder("text_completion", "cmpl-1", 123, "m")
    block = {
        "tokens": ["a", "bc"],
        "token_logprobs": [-0.5, -1.0],
        "top_logprobs": [{"a": -0.5}, None],
        "text_offset": [4, 5],
    }
    choice = {"index": 0, "text": "abc", "logprobs": block, "finish_reason": None}
    (data,) = events_of([encoder.event([choice])])
    assert CompletionResponse.model_validate(data).model_dump() == data


# --- the routes' chunk generators with merged deltas --------------------------------------------


def generation_with(
    sampling: SamplingParams, index: int = 0
) -> tuple[Generation, RequestStream, ServerState]:
    client = RecordingClient()
    state = ServerState(EngineConfig(model="m"), ServerSettings(), client, None)  # type: ignore[arg-type]
    state.begin_request()
    stream = RequestStream(f"r{index}")
    output = OutputProcessor(ByteTokenizer(512, None, (257,)), list(b"hi"), sampling)
    return Generation(state, f"r{index}", stream, output, 0.0, index), stream, state


def token_delta(
    request_id: str, text: str, start_logprob: float, finish: FinishReason | None = None
) -> RequestDelta:
    ids = list(text.encode())
    lps = [TokenLogprob(t, start_logprob - i, [(t, start_logprob - i)]) for i, t in enumerate(ids)]
    return RequestDelta(request_id, ids, lps, finish, num_prompt_tokens=2)


async def drain(chunks: AsyncIterator[bytes]) -> list[bytes]:
    return [event async for event in chunks]


def test_chat_chunk_of_merged_deltas_keeps_one_logprob_per_token() -> None:
    generation, stream, _ = generation_with(SamplingParams(max_tokens=5, logprobs=1))
    stream.put(token_delta("r0", "ab", -1.0))
    stream.put(token_delta("r0", "c", -3.0))
    stream.put(token_delta("r0", "de", -4.0, FinishReason.LENGTH))
    raw = asyncio.run(drain(chat._chunks(Choices([generation]), True, True)))
    role, content, usage = events_of(raw)
    for data in (role, content, usage):
        assert ChatCompletionChunk.model_validate(data).model_dump() == data
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    (choice,) = content["choices"]
    assert choice["delta"]["content"] == "abcde" and choice["finish_reason"] == "length"
    entries = choice["logprobs"]["content"]
    assert [e["token"] for e in entries] == list("abcde")
    assert [e["logprob"] for e in entries] == [-1.0, -2.0, -3.0, -4.0, -5.0]
    assert [e["bytes"] for e in entries] == [[ord(c)] for c in "abcde"]
    assert [e["top_logprobs"][0]["token"] for e in entries] == list("abcde")
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5


def test_completion_offsets_continue_across_merged_chunks() -> None:
    generation, stream, _ = generation_with(SamplingParams(max_tokens=5, logprobs=1))

    async def scenario() -> list[bytes]:
        chunks = completions._chunks(Choices([generation]), True, False)
        stream.put(token_delta("r0", "ab", -1.0))
        first = await anext(chunks)
        stream.put(token_delta("r0", "c", -3.0))
        stream.put(token_delta("r0", "de", -4.0, FinishReason.LENGTH))
        return [first, *[event async for event in chunks]]

    first, second = events_of(asyncio.run(scenario()))
    for data in (first, second):
        assert CompletionResponse.model_validate(data).model_dump() == data
    assert first["choices"][0]["text"] == "ab"
    assert first["choices"][0]["logprobs"]["text_offset"] == [0, 1]
    assert second["choices"][0]["text"] == "cde"
    block = second["choices"][0]["logprobs"]
    assert block["tokens"] == ["c", "d", "e"]
    assert block["token_logprobs"] == [-3.0, -4.0, -5.0]
    assert block["top_logprobs"] == [{"c": -3.0}, {"d": -4.0}, {"e": -5.0}]
    assert block["text_offset"] == [2, 3, 4]
    assert second["choices"][0]["finish_reason"] == "length"


# --- end to end: the benchmark's core sends several tokens per step -----------------------------

TOKENS_PER_STEP = 5


@contextlib.contextmanager
def serve_stream_core(tokens_per_step: int) -> Iterator[FakeServer]:
    previous = os.environ.get(TOKENS_PER_STEP_ENV)
    os.environ[TOKENS_PER_STEP_ENV] = str(tokens_per_step)  # read by the spawned core process
    try:
        app = create_app(
            EngineConfig(model=MODEL, max_model_len=4096),
            core_factory="davit_tools.bench.api_stream:StreamCore",
            tokenizer_loader=byte_tokenizer,
        )
        with threaded_server(app) as base_url:
            yield FakeServer(base_url, app.state.davit)
    finally:
        if previous is None:
            os.environ.pop(TOKENS_PER_STEP_ENV, None)
        else:
            os.environ[TOKENS_PER_STEP_ENV] = previous


@pytest.fixture(scope="module")
def stream_server() -> Iterator[FakeServer]:
    with serve_stream_core(TOKENS_PER_STEP) as server:
        yield server


def script(n: int, seed: int = 0) -> str:
    return "".join(chr(SCRIPT[(i + seed) % len(SCRIPT)]) for i in range(n))


def test_chat_stream_of_multi_token_chunks_matches_the_whole_reply(
    stream_server: FakeServer,
) -> None:
    client = stream_server.client()
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 23,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    # Five tokens a step (steps may merge further on the way): 23 = 4 * 5 + 3.
    sizes = [len(c.choices[0].delta.content or "") for c in content_chunks]
    assert all(size % 5 == 0 for size in sizes[:-1]) and sizes[-1] % 5 == 3, sizes
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == whole.choices[0].message.content == script(23)
    entries = [
        e
        for c in content_chunks
        if c.choices[0].logprobs is not None
        for e in (c.choices[0].logprobs.content or [])
    ]
    assert whole.choices[0].logprobs is not None and whole.choices[0].logprobs.content is not None
    assert [e.model_dump() for e in entries] == [
        e.model_dump() for e in whole.choices[0].logprobs.content
    ]
    for chunk in content_chunks:
        piece = chunk.choices[0]
        assert piece.logprobs is not None and piece.logprobs.content is not None
        assert "".join(e.token for e in piece.logprobs.content) == piece.delta.content
    for entry, char in zip(entries, script(23), strict=True):
        assert entry.token == char and entry.logprob == -0.5
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == [
            (char, -0.5),
            (chr(ord(char) + 1), -1.5),
        ]
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert chunks[-1].usage.completion_tokens == 23


def test_completion_stream_with_n_keeps_choices_apart(stream_server: FakeServer) -> None:
    client = stream_server.client()
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=[72, 105],
            n=3,
            seed=4,
            max_tokens=12,
            logprobs=1,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = {j: "" for j in range(3)}
    offsets: dict[int, list[int]] = {j: [] for j in range(3)}
    tokens: dict[int, list[str]] = {j: [] for j in range(3)}
    finishes = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            assert choice.logprobs is not None
            offsets[choice.index] += choice.logprobs.text_offset or []
            tokens[choice.index] += choice.logprobs.tokens or []
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {j: script(12, 4 + j) for j in range(3)}
    assert tokens == {j: list(script(12, 4 + j)) for j in range(3)}
    assert offsets == {j: list(range(12)) for j in range(3)}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 36 and usage.prompt_tokens == 2
